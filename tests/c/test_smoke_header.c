/*
 * The public header compiles as strict C99 (-std=c99 -Wall -Wextra -pedantic
 * -Werror, set in tests/c/CMakeLists.txt), is self-contained, and agrees with
 * the library it is linked to. A plain program: no cmocka.
 */
#include <kvh/kvh.h>
#include <kvh/kvh.h> /* include guard */

#include <stdio.h>
#include <string.h>

static int failures = 0;

static void check(int ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "FAIL: %s\n", what);
        failures++;
    }
}

/* Every status in the X-macro list has a name and a description. */
#define KVH_CHECK_STATUS_(name, value, text)                                                                           \
    check((int)(name) == (value), #name " has its listed value");                                                      \
    check(kvh_status_name(name) != NULL && strcmp(kvh_status_name(name), #name) == 0, "kvh_status_name(" #name ")");   \
    check(kvh_strerror(name) != NULL && kvh_strerror(name)[0] != '\0', "kvh_strerror(" #name ")");

int main(void)
{
    char expect[32];
    const char *vs;

    check(kvh_version() == KVH_VERSION_NUMBER, "kvh_version() == KVH_VERSION_NUMBER");
    check(KVH_VERSION_NUMBER == KVH_VERSION_MAJOR * 10000 + KVH_VERSION_MINOR * 100 + KVH_VERSION_PATCH,
          "KVH_VERSION_NUMBER matches MAJOR/MINOR/PATCH");

    snprintf(expect, sizeof expect, "%d.%d.%d", KVH_VERSION_MAJOR, KVH_VERSION_MINOR, KVH_VERSION_PATCH);
    vs = kvh_version_string();
    check(vs != NULL && strcmp(vs, expect) == 0, "kvh_version_string() == MAJOR.MINOR.PATCH");

    KVH_STATUS_LIST(KVH_CHECK_STATUS_)
    check(kvh_strerror(-9999) != NULL, "kvh_strerror(unknown code) is not NULL");

    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("kvh %s: public header OK as C99 (version %u)\n", vs, (unsigned)kvh_version());
    return 0;
}
