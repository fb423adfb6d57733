/*
 * edgeline firmware bridge, wire protocol version 1: the board's side (docs/firmware-protocol.md).
 *
 * C99, header only, no allocation, nothing of libc beyond <stdint.h>, <stddef.h> and <string.h>. Encoding writes
 * into the caller's buffer; decoding takes one byte at a time (from a UART interrupt or a polling loop).
 *
 * A frame is COBS-encoded and ends with one 0x00 byte. Decoded, little-endian:
 *   u8 version (1) | u8 type | u8 flags | u8 stream | u16 seq | u64 t_us | payload | u32 crc32
 * crc32 is IEEE CRC-32 (as zlib.crc32) over every byte before it. The largest frame is 4,096 bytes decoded.
 */
#ifndef EDGELINE_FRAME_H
#define EDGELINE_FRAME_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define EL_VERSION 1u
#define EL_HEADER_SIZE 14u
#define EL_CRC_SIZE 4u
#define EL_MAX_FRAME 4096u
#define EL_MAX_PAYLOAD (EL_MAX_FRAME - EL_HEADER_SIZE - EL_CRC_SIZE)
#define EL_MAX_ENCODED (EL_MAX_FRAME + EL_MAX_FRAME / 254u + 2u)
#define EL_FLAG_ACK_REQUESTED 0x01u
#define EL_FLAGS_MUST_UNDERSTAND 0xF0u

enum el_type {
    EL_HELLO = 1, EL_SAMPLES = 2, EL_RESULT = 3, EL_HEARTBEAT = 4, EL_LOG = 5, EL_ACK = 6,
    EL_ANSWER = 16, EL_CONFIG = 17, EL_HELLO_REQUEST = 18
};

typedef struct {
    uint8_t type;
    uint8_t flags;
    uint8_t stream;
    uint16_t seq;
    uint64_t t_us;
    const uint8_t *payload; /* decoding: points into the decoder's buffer, valid until the next byte is fed */
    size_t payload_len;
} el_frame;

/* IEEE CRC-32 (reflected, polynomial 0xEDB88320), bit by bit: no table in flash. el_crc32(0, data, n) equals
 * zlib.crc32(data); pass the previous result to continue over more bytes. */
static inline uint32_t el_crc32(uint32_t crc, const uint8_t *data, size_t len) {
    crc = ~crc;
    for (size_t i = 0; i < len; i++) {
        crc ^= data[i];
        for (int bit = 0; bit < 8; bit++) {
            crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
        }
    }
    return ~crc;
}

typedef struct {
    uint8_t *out;
    size_t cap, pos, code_pos;
    uint8_t code;
    int full;
} el_cobs_writer_;

static inline void el_put_(el_cobs_writer_ *w, uint8_t byte) {
    if (w->full) return;
    if (byte == 0) {
        w->out[w->code_pos] = w->code;
        w->code_pos = w->pos++;
        w->code = 1;
    } else {
        w->out[w->pos++] = byte;
        w->code++;
        if (w->code == 0xFF) {
            w->out[w->code_pos] = w->code;
            w->code_pos = w->pos++;
            w->code = 1;
        }
    }
    if (w->pos >= w->cap) w->full = 1;
}

/* Encode `frame` into `out` (capacity `cap`, EL_MAX_ENCODED always suffices): the COBS bytes and the 0x00
 * delimiter. Returns the bytes written, or 0 when the payload is over EL_MAX_PAYLOAD or `out` is too small. */
static inline size_t el_encode(const el_frame *frame, uint8_t *out, size_t cap) {
    uint8_t header[EL_HEADER_SIZE];
    uint8_t crc_bytes[EL_CRC_SIZE];
    el_cobs_writer_ w;
    uint32_t crc;
    if (frame->payload_len > EL_MAX_PAYLOAD || cap < 2) return 0;
    header[0] = EL_VERSION;
    header[1] = frame->type;
    header[2] = frame->flags;
    header[3] = frame->stream;
    header[4] = (uint8_t)(frame->seq & 0xFF);
    header[5] = (uint8_t)(frame->seq >> 8);
    for (int i = 0; i < 8; i++) header[6 + i] = (uint8_t)(frame->t_us >> (8 * i));
    crc = el_crc32(0, header, sizeof header);
    if (frame->payload_len) crc = el_crc32(crc, frame->payload, frame->payload_len);
    for (int i = 0; i < 4; i++) crc_bytes[i] = (uint8_t)(crc >> (8 * i));
    w.out = out; w.cap = cap; w.pos = 1; w.code_pos = 0; w.code = 1; w.full = 0;
    for (size_t i = 0; i < sizeof header; i++) el_put_(&w, header[i]);
    for (size_t i = 0; i < frame->payload_len; i++) el_put_(&w, frame->payload[i]);
    for (size_t i = 0; i < sizeof crc_bytes; i++) el_put_(&w, crc_bytes[i]);
    if (w.full || w.pos + 1 > cap) return 0;
    out[w.code_pos] = w.code;
    out[w.pos++] = 0;
    return w.pos;
}

/* What a decoder refused, by reason (as the host counts them). */
typedef struct {
    uint32_t frames, cobs, shorts, crc, version, flags, type, size;
} el_counts;

typedef struct {
    uint8_t buf[EL_MAX_FRAME];
    size_t len;
    uint8_t code;     /* the current block's code byte (0: none yet) */
    uint8_t left;     /* data bytes left in the current block */
    uint8_t overflow; /* more bytes than a frame holds since the last delimiter */
    el_counts counts;
} el_decoder;

static inline void el_decoder_init(el_decoder *d) { memset(d, 0, sizeof *d); }

static inline int el_known_type_(uint8_t type) {
    return (type >= EL_HELLO && type <= EL_ACK) || (type >= EL_ANSWER && type <= EL_HELLO_REQUEST);
}

/* Feed one byte. Returns 1 when it completed a valid frame, filled into `frame` (its payload points into the
 * decoder, valid until the next byte); 0 otherwise (a refused frame is counted in d->counts). */
static inline int el_decode_byte(el_decoder *d, uint8_t byte, el_frame *frame) {
    if (byte != 0) {
        if (d->overflow) return 0;
        if (d->left == 0) { /* a code byte: the block before it (if short of 254) ended with an implied zero */
            if (d->code != 0 && d->code != 0xFF) {
                if (d->len >= EL_MAX_FRAME) { d->overflow = 1; return 0; }
                d->buf[d->len++] = 0;
            }
            d->code = byte;
            d->left = (uint8_t)(byte - 1);
        } else {
            if (d->len >= EL_MAX_FRAME) { d->overflow = 1; return 0; }
            d->buf[d->len++] = byte;
            d->left--;
        }
        return 0;
    }
    /* the delimiter: judge what came since the last one */
    int ok = 0;
    size_t len = d->len;
    if (d->overflow) {
        d->counts.size++;
    } else if (d->code == 0) {
        /* nothing since the last delimiter */
    } else if (d->left != 0) {
        d->counts.cobs++;
    } else if (len < EL_HEADER_SIZE + EL_CRC_SIZE) {
        d->counts.shorts++;
    } else {
        const uint8_t *b = d->buf;
        uint32_t want = (uint32_t)b[len - 4] | ((uint32_t)b[len - 3] << 8) | ((uint32_t)b[len - 2] << 16) |
                        ((uint32_t)b[len - 1] << 24);
        if (el_crc32(0, b, len - EL_CRC_SIZE) != want) {
            d->counts.crc++;
        } else if (b[0] != EL_VERSION) {
            d->counts.version++;
        } else if (b[2] & EL_FLAGS_MUST_UNDERSTAND) {
            d->counts.flags++;
        } else if (!el_known_type_(b[1])) {
            d->counts.type++;
        } else {
            frame->type = b[1];
            frame->flags = b[2];
            frame->stream = b[3];
            frame->seq = (uint16_t)(b[4] | (b[5] << 8));
            frame->t_us = 0;
            for (int i = 7; i >= 0; i--) frame->t_us = (frame->t_us << 8) | b[6 + i];
            frame->payload = b + EL_HEADER_SIZE;
            frame->payload_len = len - EL_HEADER_SIZE - EL_CRC_SIZE;
            d->counts.frames++;
            ok = 1;
        }
    }
    d->len = 0;
    d->code = 0;
    d->left = 0;
    d->overflow = 0;
    return ok;
}

#endif /* EDGELINE_FRAME_H */
