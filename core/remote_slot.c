/* Redis Cluster key slots (core/remote_cluster.h): pure, so built with or
 * without hiredis. */
#include "core/remote_cluster.h"

#include <stdint.h>
#include <string.h>

/* CRC16-CCITT (XMODEM: polynomial 0x1021, initial 0), as Redis Cluster
 * defines key slots. */
static uint16_t crc16(const uint8_t *p, size_t n)
{
    uint16_t crc = 0;
    for (size_t i = 0; i < n; i++) {
        crc ^= (uint16_t)(p[i] << 8);
        for (int b = 0; b < 8; b++)
            crc = (crc & 0x8000) ? (uint16_t)(crc << 1 ^ 0x1021) : (uint16_t)(crc << 1);
    }
    return crc;
}

uint32_t kvhi_cluster_key_slot(const char *key, size_t len)
{
    /* Only the part between the first '{' and the next '}' is hashed,
     * when that part is not empty. */
    const char *open = memchr(key, '{', len);
    if (open) {
        size_t at = (size_t)(open - key) + 1;
        const char *close = memchr(key + at, '}', len - at);
        if (close && close > key + at)
            return crc16((const uint8_t *)key + at, (size_t)(close - (key + at))) % KVHI_CLUSTER_SLOTS;
    }
    return crc16((const uint8_t *)key, len) % KVHI_CLUSTER_SLOTS;
}
