/* Exported status text, error detail and version. */
#include "core/engine.h"

const char *kvh_last_error(void) { return kvhi_last_error(); }

const char *kvh_strerror(kvh_status status) { return kvhi_status_text(status); }

const char *kvh_status_name(kvh_status status) { return kvhi_status_name(status); }

uint32_t kvh_version(void) { return KVH_VERSION_NUMBER; }

const char *kvh_version_string(void)
{
#define KVHI_STR2(x) #x
#define KVHI_STR(x) KVHI_STR2(x)
    return KVHI_STR(KVH_VERSION_MAJOR) "." KVHI_STR(KVH_VERSION_MINOR) "." KVHI_STR(KVH_VERSION_PATCH);
}
