/* Names of configuration values, as kvh_config_from_env reads them
 * (core/config_env.c), for tools and messages that print them. */
#ifndef KVH_CORE_CONFIG_NAMES_H
#define KVH_CORE_CONFIG_NAMES_H

#include <stdint.h>

/* The name of a kvh_dtype and of a kvh_codec; NULL for a value no engine
 * has. */
const char *kvhi_dtype_name(uint32_t dtype);
const char *kvhi_codec_name(uint32_t codec);
/* The KVH_* variable that sets the kvh_config field of that name
 * ("block_tokens": "KVH_BLOCK_TOKENS"); NULL for a field none sets. */
const char *kvhi_config_env_var(const char *name);

#endif
