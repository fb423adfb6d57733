/*
 * The emulated sensor board: a bare-metal firmware for QEMU's mps2-an386 (Cortex-M4) that speaks the firmware
 * bridge's wire protocol (docs/firmware-protocol.md, "Sessions") over UART0, so the host's side can be tested against
 * a real board's code, with a real board's timing, without a board. edgeline.sim.mcu builds and starts it;
 * edgeline.sim.board.PythonBoard does the same in Python where QEMU is missing: keep the two alike.
 *
 * What it does: at boot a HELLO on stream 0; then SAMPLES on stream 1 at RATE, COUNT of them, from samples compiled
 * in (looping over them); a HEARTBEAT on stream 0 every second, followed by a LOG "stats {json}" of its counters.
 * It reads the UART by polling, a byte at a time, and never lets a slow host block its clock: HELLO_REQUEST is
 * answered with a HELLO (and, reliable, a resend of the window), ACK releases the window, ANSWER is counted, CONFIG
 * sets the rate and turns the stream on and off. Reliable (flag bit 0 on SAMPLES): up to WINDOW frames unacknowledged
 * kept as sent, a wait when the window is full, and go-back-N (the whole window again, unchanged) when the oldest has
 * waited RESEND_US.
 *
 * Built by edgeline.sim.mcu with, from the user's settings:
 *   -DDEVICE_ID="id"  -DRATE_MHZ=10000 (milli-hertz: rates below 1 Hz too)  -DCOUNT=100  -DRELIABLE=0|1
 *   -DDEAF=1 (optional): the board never reads its RX line, as many sensor firmwares; the UART's receive register
 *   stays full, so the emulator stops taking the host's bytes and the host's writes find no room
 * and samples.inc (generated from the .npz): EL_SAMPLE_COUNT, EL_SAMPLE_BYTES, EL_SAMPLE_SHAPE, EL_STREAM_NAME and
 * SAMPLE_DATA, the samples as little-endian float32 bytes.
 *
 * C99, -ffreestanding -nostdlib: the startup (vector table, .data and .bss), SysTick and the few string functions are
 * at the end of this file.
 */
#include "edgeline_frame.h"
#include "samples.inc"

#ifndef DEVICE_ID
#error "build with -DDEVICE_ID=\"id\" (edgeline.sim.mcu does)"
#endif
#ifndef RATE_MHZ
#error "build with -DRATE_MHZ=N: the sample rate in milli-hertz"
#endif
#ifndef COUNT
#error "build with -DCOUNT=N: the samples to send"
#endif
#ifndef RELIABLE
#define RELIABLE 0
#endif
#ifndef DEAF
#define DEAF 0
#endif

#define FIRMWARE "edgeline-sensor-board 1"
#define DATA_STREAM 1u
#define WINDOW 8u
#define RESEND_US 500000u
#define HEARTBEAT_US 1000000u
#define SYSCLK_HZ 25000000u /* mps2-an386's system clock, SysTick's source */
#define MAX_RATE_MHZ 100000000u /* 100 kHz: far above what a UART carries, and a period of at least 10 us */
#define RX_BURST 64u /* bytes taken from the UART per poll: the send loop stays on time under a flood */
#define SAMPLE_WIRE_MAX (EL_SAMPLE_BYTES + EL_HEADER_SIZE + EL_CRC_SIZE + \
                         (EL_SAMPLE_BYTES + EL_HEADER_SIZE + EL_CRC_SIZE) / 254u + 2u)

/* ---- UART0: the CMSDK APB UART ---------------------------------------------------------------------------------- */

#define UART_DATA (*(volatile uint32_t *)0x40004000u)
#define UART_STATE (*(volatile uint32_t *)0x40004004u)
#define UART_CTRL (*(volatile uint32_t *)0x40004008u)
#define UART_BAUDDIV (*(volatile uint32_t *)0x40004010u)
#define UART_TX_FULL 1u
#define UART_RX_FULL 2u

/* Received bytes wait here until the main loop decodes them: taking them off the UART while a frame is being sent
 * (a host that writes while the board writes) must not start a reply in the middle of that frame. */
static uint8_t rx_ring[1024];
static uint32_t rx_head, rx_tail, rx_dropped;

static void rx_poll(void) {
    if (DEAF) return; /* the only place the board reads: a deaf board takes nothing, ever */
    for (uint32_t i = 0; i < RX_BURST && (UART_STATE & UART_RX_FULL); i++) {
        uint8_t byte = (uint8_t)UART_DATA;
        if (rx_head - rx_tail < sizeof rx_ring) {
            rx_ring[rx_head++ % sizeof rx_ring] = byte;
        } else {
            rx_dropped++; /* the decoder resyncs at the next delimiter */
        }
    }
}

/* The only wait of the board: QEMU holds TX full while the host's socket is backed up (a host that stopped reading);
 * receiving goes on meanwhile. A board whose host is gone is stopped by the host killing the emulator. */
static void uart_put(uint8_t byte) {
    while (UART_STATE & UART_TX_FULL) rx_poll();
    UART_DATA = byte;
}

static void uart_write(const uint8_t *bytes, size_t n) {
    for (size_t i = 0; i < n; i++) uart_put(bytes[i]);
}

/* ---- time: SysTick at 1 kHz, the microseconds in between from its counter ---------------------------------------- */

#define SYST_CSR (*(volatile uint32_t *)0xE000E010u)
#define SYST_RVR (*(volatile uint32_t *)0xE000E014u)
#define SYST_CVR (*(volatile uint32_t *)0xE000E018u)

static volatile uint32_t ms_ticks; /* wraps after 49 days: longer than any emulated run */

void systick_handler(void) { ms_ticks++; }

static uint64_t now_us(void) {
    /* a tick between the two reads of ms_ticks makes the counter's value ambiguous: read again (a tick is 1 ms, so a
     * second try succeeds). The counter can also wrap before its interrupt is taken (late, under an emulator on a
     * busy host): the sum would go back by up to a tick. The host reads a HELLO whose t_us goes back as a board that
     * restarted, so the clock never goes back: it holds at its last value instead. */
    static uint64_t last;
    uint64_t now = (uint64_t)ms_ticks * 1000u;
    for (int attempt = 0; attempt < 3; attempt++) {
        uint32_t before = ms_ticks;
        uint32_t counter = SYST_CVR;
        if (ms_ticks == before) {
            now = (uint64_t)before * 1000u + (SYST_RVR - counter) / (SYSCLK_HZ / 1000000u);
            break;
        }
    }
    if (now < last) now = last;
    last = now;
    return now;
}

/* ---- counters and session state ---------------------------------------------------------------------------------- */

typedef struct {
    uint16_t seq;
    uint16_t len;
    uint64_t sent_at; /* last (re)sent */
    uint8_t wire[SAMPLE_WIRE_MAX];
} window_slot;

static window_slot window[WINDOW];
static uint32_t window_head, window_count;

static uint16_t control_seq, data_seq;
static uint32_t rate_mhz = RATE_MHZ;
static uint32_t period_us;
static uint64_t next_sample;
static int stream_on = 1;
static uint32_t sent, resent, acked, answers, answered, hellos;
static uint8_t answered_seqs[65536u / 8u]; /* per input seq: answered before (the distinct count) */
static uint8_t tx[EL_MAX_ENCODED];
static el_decoder decoder;

static void send_frame(uint8_t type, uint8_t stream, uint16_t seq, const uint8_t *payload, size_t n) {
    el_frame frame = {type, 0, stream, seq, now_us(), payload, n};
    size_t len = el_encode(&frame, tx, sizeof tx);
    uart_write(tx, len);
}

static void send_control(uint8_t type, const uint8_t *payload, size_t n) { send_frame(type, 0, control_seq++, payload, n); }

/* ---- a small text builder for HELLO and the stats line: no printf on a bare board ------------------------------- */

typedef struct {
    char buf[512];
    size_t len;
} text;

static void put_str(text *t, const char *s) {
    while (*s && t->len < sizeof t->buf) t->buf[t->len++] = *s++;
}

static void put_u32(text *t, uint32_t v) {
    char digits[10];
    int n = 0;
    do {
        digits[n++] = (char)('0' + v % 10u);
        v /= 10u;
    } while (v);
    while (n && t->len < sizeof t->buf) t->buf[t->len++] = digits[--n];
}

/* milli-hertz as a JSON number: 10000 -> 10.0, 2500 -> 2.5, 125 -> 0.125 */
static void put_rate(text *t, uint32_t mhz) {
    uint32_t fraction = mhz % 1000u;
    put_u32(t, mhz / 1000u);
    put_str(t, ".");
    if (fraction == 0) {
        put_str(t, "0");
        return;
    }
    for (uint32_t place = 100u; place && fraction; place /= 10u) {
        put_u32(t, fraction / place);
        fraction %= place;
    }
}

static void send_text(uint8_t type, const text *t) { send_control(type, (const uint8_t *)t->buf, t->len); }

/* This boot's number, so that the host's ids of this boot's inputs differ from the last boot's (the same seq can
 * come at the same microsecond after every boot of a board that samples on a timer). A real board keeps it in flash or
 * draws it from a random source; this one keeps it in RAM that a reset leaves alone (.noinit), so it counts the
 * resets of one emulator's run and starts again at 0 in a new one. */
#define BOOT_MAGIC 0xB007C0DEu
__attribute__((section(".noinit"))) static uint32_t boot_magic, boot_count;

static void count_boot(void) {
    if (boot_magic == BOOT_MAGIC) {
        boot_count++;
    } else {
        boot_magic = BOOT_MAGIC;
        boot_count = 0;
    }
}

static uint16_t oldest_held_seq(void) { return window_count ? window[window_head].seq : data_seq; }

static void send_hello(void) {
    text t = {{0}, 0};
    put_str(&t, "{\"device\": \"" DEVICE_ID "\", \"firmware\": \"" FIRMWARE "\", \"protocol\": 1, \"boot\": ");
    put_u32(&t, boot_count);
    put_str(&t, ", \"streams\": [");
    put_str(&t, "{\"id\": 1, \"name\": \"" EL_STREAM_NAME "\", \"dtype\": \"f32\", \"shape\": " EL_SAMPLE_SHAPE);
    put_str(&t, ", \"rate_hz\": ");
    put_rate(&t, rate_mhz);
    put_str(&t, ", \"seq\": ");
    put_u32(&t, oldest_held_seq());
    put_str(&t, "}]}");
    hellos++;
    send_text(EL_HELLO, &t);
}

static int finished(void) { return sent >= (uint32_t)COUNT && window_count == 0; }

static void send_stats(void) {
    text t = {{0}, 0};
    const el_counts *c = &decoder.counts;
    put_str(&t, "stats {\"sent\": ");
    put_u32(&t, sent);
    put_str(&t, ", \"resent\": ");
    put_u32(&t, resent);
    put_str(&t, ", \"acked\": ");
    put_u32(&t, acked);
    put_str(&t, ", \"answers\": ");
    put_u32(&t, answers);
    put_str(&t, ", \"answered\": ");
    put_u32(&t, answered);
    put_str(&t, ", \"hello\": ");
    put_u32(&t, hellos);
    put_str(&t, ", \"refused\": ");
    put_u32(&t, c->cobs + c->shorts + c->crc + c->version + c->flags + c->type + c->size + rx_dropped);
    put_str(&t, ", \"done\": ");
    put_str(&t, finished() ? "true" : "false");
    put_str(&t, "}");
    send_text(EL_LOG, &t);
}

/* ---- samples and the reliable window ------------------------------------------------------------------------------ */

static void send_sample(uint64_t now) {
    const uint8_t *sample = SAMPLE_DATA + (size_t)(sent % EL_SAMPLE_COUNT) * EL_SAMPLE_BYTES;
    el_frame frame = {EL_SAMPLES, RELIABLE ? EL_FLAG_ACK_REQUESTED : 0u, DATA_STREAM, data_seq, now, sample,
                      EL_SAMPLE_BYTES};
    if (RELIABLE) { /* encoded straight into the window: a resend is the frame again, byte for byte */
        window_slot *slot = &window[(window_head + window_count) % WINDOW];
        slot->seq = data_seq;
        slot->sent_at = now;
        slot->len = (uint16_t)el_encode(&frame, slot->wire, sizeof slot->wire);
        window_count++;
        uart_write(slot->wire, slot->len);
    } else {
        uart_write(tx, el_encode(&frame, tx, sizeof tx));
    }
    data_seq++;
    sent++;
}

static void resend_window(uint64_t now) {
    for (uint32_t i = 0; i < window_count; i++) {
        window_slot *slot = &window[(window_head + i) % WINDOW];
        slot->sent_at = now;
        uart_write(slot->wire, slot->len);
        resent++;
    }
}

static void release_up_to(uint16_t seq) {
    /* every held frame at or before seq, modulo 65,536: an ACK more than half the sequence space ahead is stale */
    while (window_count && (uint16_t)(seq - window[window_head].seq) < 0x8000u) {
        window_head = (window_head + 1u) % WINDOW;
        window_count--;
        acked++;
    }
}

/* ---- what the host sends ------------------------------------------------------------------------------------------ */

static const uint8_t *find(const uint8_t *from, const uint8_t *end, const char *needle) {
    size_t n = strlen(needle);
    for (const uint8_t *p = from; p + n <= end; p++) {
        if (memcmp(p, needle, n) == 0) return p + n;
    }
    return 0;
}

static const uint8_t *after_colon(const uint8_t *p, const uint8_t *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r' || *p == ':')) p++;
    return p;
}

/* "rate_hz": 12.5 as milli-hertz; 0 when it is not a positive number of at most three decimals */
static uint32_t parse_rate(const uint8_t *p, const uint8_t *end) {
    uint32_t whole = 0, fraction = 0, places = 0;
    int digits = 0;
    for (; p < end && *p >= '0' && *p <= '9' && whole <= MAX_RATE_MHZ / 1000u; p++, digits++) {
        whole = whole * 10u + (uint32_t)(*p - '0');
    }
    if (p < end && *p == '.') {
        for (p++; p < end && *p >= '0' && *p <= '9'; p++, digits++) {
            if (places < 3u) {
                fraction = fraction * 10u + (uint32_t)(*p - '0');
                places++;
            }
        }
    }
    if (!digits || whole > MAX_RATE_MHZ / 1000u) return 0;
    while (places < 3u) {
        fraction *= 10u;
        places++;
    }
    return whole * 1000u + fraction;
}

static void apply_config(const uint8_t *payload, size_t n, uint64_t now) {
    const uint8_t *end = payload + n;
    const uint8_t *rate = find(payload, end, "\"rate_hz\"");
    if (rate) {
        uint32_t mhz = parse_rate(after_colon(rate, end), end);
        if (mhz == 0 || mhz > MAX_RATE_MHZ) {
            text t = {{0}, 0};
            put_str(&t, "config refused: rate_hz must be a number above 0 and at most 100000, with 3 decimals");
            send_text(EL_LOG, &t);
        } else {
            rate_mhz = mhz;
            period_us = 1000000000u / rate_mhz;
            if (next_sample > now + period_us) next_sample = now + period_us; /* a faster rate starts now */
        }
    }
    const uint8_t *streams = find(payload, end, "\"streams\"");
    const uint8_t *ours = streams ? find(streams, end, "\"1\"") : 0;
    if (ours) {
        const uint8_t *value = after_colon(ours, end);
        if (value < end && (*value == 't' || *value == 'f')) stream_on = *value == 't';
    }
}

static void handle(const el_frame *frame, uint64_t now) {
    switch (frame->type) {
    case EL_HELLO_REQUEST:
        send_hello();
        if (RELIABLE) resend_window(now);
        break;
    case EL_ACK:
        if (frame->payload_len == 3u && frame->payload[0] == DATA_STREAM) {
            release_up_to((uint16_t)(frame->payload[1] | (frame->payload[2] << 8)));
        }
        break;
    case EL_ANSWER:
        answers++;
        if (frame->stream == DATA_STREAM) {
            uint8_t *byte = &answered_seqs[frame->seq / 8u];
            uint8_t bit = (uint8_t)(1u << (frame->seq % 8u));
            if (!(*byte & bit)) {
                *byte |= bit;
                answered++;
            }
        }
        break;
    case EL_CONFIG:
        apply_config(frame->payload, frame->payload_len, now);
        break;
    default:
        break; /* board-to-host types: nothing for a board to do */
    }
    if ((frame->flags & EL_FLAG_ACK_REQUESTED) && frame->type != EL_ACK) {
        uint8_t ack[3] = {frame->stream, (uint8_t)(frame->seq & 0xFFu), (uint8_t)(frame->seq >> 8)};
        send_control(EL_ACK, ack, sizeof ack);
    }
}

static void receive(uint64_t now) {
    rx_poll();
    for (uint32_t i = 0; i < RX_BURST && rx_tail != rx_head; i++) {
        el_frame frame;
        if (el_decode_byte(&decoder, rx_ring[rx_tail++ % sizeof rx_ring], &frame)) handle(&frame, now);
    }
}

static void board_main(void) {
    UART_BAUDDIV = 16u; /* the smallest divider the CMSDK UART takes: QEMU ignores the rate itself */
    UART_CTRL = 3u;     /* TX and RX on */
    SYST_RVR = SYSCLK_HZ / 1000u - 1u;
    SYST_CVR = 0;
    SYST_CSR = 7u; /* processor clock, interrupt, on */
    el_decoder_init(&decoder);
    period_us = 1000000000u / rate_mhz;
    uart_put(0); /* a reset may have cut a frame short: end it, or the host takes it and the HELLO for one frame */
    count_boot();
    send_hello();
    next_sample = now_us();
    uint64_t last_heartbeat = next_sample;
    /* A board runs until it loses power: the host stops the emulator. Each pass is bounded (RX_BURST bytes in, at
     * most a heartbeat, a window and a sample out). */
    for (;;) {
        receive(now_us());
        uint64_t now = now_us();
        if (now - last_heartbeat >= HEARTBEAT_US) {
            last_heartbeat = now;
            send_control(EL_HEARTBEAT, 0, 0);
            send_stats();
        }
        if (RELIABLE && window_count && now - window[window_head].sent_at >= RESEND_US) resend_window(now);
        if (sent < (uint32_t)COUNT && stream_on && now >= next_sample && (!RELIABLE || window_count < WINDOW)) {
            send_sample(now);
            next_sample += period_us;
            if (next_sample + period_us < now) next_sample = now; /* waited on a full window: no burst to catch up */
        }
    }
}

/* ---- startup: -nostdlib, so the vector table, .data, .bss and libc's few string functions are ours ---------------- */

void *memset(void *dest, int c, size_t n) {
    uint8_t *p = dest;
    while (n--) *p++ = (uint8_t)c;
    return dest;
}

void *memcpy(void *dest, const void *src, size_t n) {
    uint8_t *p = dest;
    const uint8_t *q = src;
    while (n--) *p++ = *q++;
    return dest;
}

int memcmp(const void *a, const void *b, size_t n) {
    const uint8_t *p = a, *q = b;
    for (; n; n--, p++, q++) {
        if (*p != *q) return *p - *q;
    }
    return 0;
}

size_t strlen(const char *s) {
    size_t n = 0;
    while (s[n]) n++;
    return n;
}

extern uint32_t _sidata, _sdata, _edata, _sbss, _ebss, _stack_top;

void reset_handler(void) {
    const uint32_t *from = &_sidata;
    for (uint32_t *p = &_sdata; p < &_edata;) *p++ = *from++;
    for (uint32_t *p = &_sbss; p < &_ebss;) *p++ = 0;
    board_main();
}

void fault_handler(void) {
    for (;;) {} /* a fault stops the board: the host sees its heartbeats stop */
}

__attribute__((section(".vectors"), used)) static const void *const VECTORS[16] = {
    &_stack_top,          (void *)reset_handler, (void *)fault_handler, (void *)fault_handler,
    (void *)fault_handler, (void *)fault_handler, (void *)fault_handler, 0,
    0,                    0,                     0,                     (void *)fault_handler,
    (void *)fault_handler, 0,                    (void *)fault_handler, (void *)systick_handler,
};
