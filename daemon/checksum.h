/*
 * checksum.h - the remote tier's checksum (remote_value.h, migrate.h):
 * CRC-32 as zlib's crc32 and gzip compute it (IEEE 802.3, reflected,
 * polynomial 0xEDB88320), through Intel's ISA-L, whose folding with
 * carry-less multiplies runs about five times zlib's speed on this class of
 * machine (a Revive of spilled victims checks every byte it fetches:
 * docs/bench.md "Spill and revive"). The values are zlib's, so that any
 * reader checks them with crc32_z. Thread-safe: no state.
 */
#ifndef KVSTASH_CHECKSUM_H
#define KVSTASH_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

/* The CRC-32 of p[0..n) continuing crc (0 to start): crc32_z(crc, p, n). */
uint32_t checksum_crc32(uint32_t crc, const void *p, size_t n);

#endif
