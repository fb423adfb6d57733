/* Another x86-64 CPU for this process and its children: an LD_PRELOAD library that hides instruction sets from
 * CPUID, so that runtimes which choose their kernels by CPUID (oneDNN and OpenVINO's CPU plugin, ONNX Runtime's
 * MLAS, XNNPACK through cpuinfo, PyTorch) choose what they would on a smaller CPU. edgeline.sim.cpu_kind builds it
 * and says what each kind hides.
 *
 * How: arch_prctl(ARCH_SET_CPUID, 0) makes the CPUID instruction fault in this thread (CPUID faulting, an Intel
 * feature that KVM also gives its guests: the "cpuid_fault" flag of /proc/cpuinfo); the SIGSEGV that follows is
 * answered here with the real CPUID's values less the hidden bits, and the program goes on after the instruction.
 * The setting is inherited by threads and children and reset by execve, where this library (LD_PRELOAD) sets it
 * again. The program's own SIGSEGV handlers (Python's faulthandler) are kept and called for every other fault, and
 * no thread may block SIGSEGV (see ``unblocked``). The handler runs on the faulting thread's own stack, never an
 * alternate one: with SA_ONSTACK, the whole suite lost 9 pytest workers inside OpenVINO's device enumeration (the
 * kernel could not write the signal frame, AVX-512 state included, to an alternate stack some library had set,
 * reset the handler and killed the process at the next CPUID). A real stack overflow then dies without the program's
 * own report.
 *
 * Not hidden: what glibc read before this library loaded (its string functions may still use AVX-512: they compute
 * no figures), statically linked programs, and a child started without LD_PRELOAD in its environment. XGETBV is not
 * masked; no runtime uses a state component whose CPUID feature bit is hidden.
 *
 * EDGELINE_CPU_KIND: avx2 | avx512-vnni | avx512-vnni-bf16 (anything else: nothing hidden). EDGELINE_CPU_VENDOR=amd
 * also says AuthenticAMD, family 19h: only where a runtime chooses by vendor (its other leaves stay Intel's).
 */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

enum kind { HOST, AVX2, AVX512_VNNI, AVX512_VNNI_BF16 };

static enum kind kind = HOST;
static struct sigaction next_segv; /* the program's own SIGSEGV disposition */
static int (*real_sigaction)(int, const struct sigaction *, struct sigaction *);

#define BIT(n) (1u << (n))
/* CPUID.(EAX=7,ECX=0) */
static const unsigned L7_EBX_AVX512 = BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30) | BIT(31);
static const unsigned L7_ECX_AVX512 = BIT(1) | BIT(6) | BIT(11) | BIT(12) | BIT(14); /* VBMI VBMI2 VNNI BITALG POPCNT */
static const unsigned L7_EDX_AVX512 = BIT(2) | BIT(3) | BIT(8) | BIT(23); /* 4VNNIW 4FMAPS VP2INTERSECT FP16 */
static const unsigned L7_EDX_AMX = BIT(22) | BIT(24) | BIT(25);          /* AMX-BF16 AMX-TILE AMX-INT8 */
/* CPUID.(EAX=7,ECX=1) */
static const unsigned L71_EAX_AVX_VEX = BIT(4) | BIT(23);   /* AVX-VNNI AVX-IFMA (Alder Lake, Sapphire Rapids on) */
static const unsigned L71_EAX_AVX512_BF16 = BIT(5);
static const unsigned L71_EAX_AMX = BIT(21);                /* AMX-FP16 */
static const unsigned L71_EDX_NEWER = BIT(4) | BIT(5) | BIT(8) | BIT(10) | BIT(19); /* VNNI-INT8 NE-CONVERT
                                                                 AMX-COMPLEX VNNI-INT16 AVX10 */
/* CPUID.(EAX=0xD,ECX=0): the state components XSAVE manages */
static const unsigned LD_EAX_AVX512 = BIT(5) | BIT(6) | BIT(7);
static const unsigned LD_EAX_AMX = BIT(17) | BIT(18);

static int amd; /* EDGELINE_CPU_VENDOR=amd: AuthenticAMD, family 19h model 11h (Zen 4, EPYC Genoa) */

static void hide(unsigned leaf, unsigned sub, unsigned *a, unsigned *b, unsigned *c, unsigned *d) {
    if (kind == HOST) return;
    if (amd && leaf == 0) {
        memcpy(b, "Auth", 4);
        memcpy(d, "enti", 4);
        memcpy(c, "cAMD", 4);
    } else if (amd && leaf == 1) {
        *a = 0x00A10F11;
    }
    if (leaf == 7 && sub == 0) {
        *d &= ~(L7_EDX_AMX | BIT(23) | BIT(8)); /* no AVX512-FP16 nor VP2INTERSECT on any kind here */
        if (kind == AVX2) {
            *b &= ~L7_EBX_AVX512;
            *c &= ~L7_ECX_AVX512;
            *d &= ~L7_EDX_AVX512;
        } else { /* the AVX-512 of Ice Lake and Zen 4 stays, VNNI included; Xeon Phi's goes */
            *d &= ~(BIT(2) | BIT(3));
        }
    } else if (leaf == 7 && sub == 1) {
        *a &= ~(L71_EAX_AVX_VEX | L71_EAX_AMX);
        if (kind != AVX512_VNNI_BF16) *a &= ~L71_EAX_AVX512_BF16;
        *d &= ~L71_EDX_NEWER;
    } else if (leaf == 0xD && sub == 0) {
        *a &= ~LD_EAX_AMX;
        if (kind == AVX2) *a &= ~LD_EAX_AVX512;
    } else if (leaf == 0x1D || leaf == 0x1E || leaf == 0x24) { /* AMX tile and TMUL information, AVX10 */
        *a = *b = *c = *d = 0;
    }
}

/* Which kind this process runs as (0: the host's CPU): what edgeline.sim.cpu_kind checks before it trusts a run. */
int edgeline_cpu_kind(void) { return (int)kind; }

static void set_faulting(int on) { syscall(SYS_arch_prctl, ARCH_SET_CPUID, on ? 0 : 1); }

static void chain(int sig, siginfo_t *info, void *context) {
    struct sigaction next = next_segv;
    if (next.sa_handler == SIG_IGN) return;
    if (next.sa_handler == SIG_DFL) { /* die as the program would have: the fault repeats, or the signal is sent again */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        real_sigaction(SIGSEGV, &dfl, NULL);
        if (info->si_code <= 0) raise(SIGSEGV);
        return;
    }
    if (next.sa_flags & SA_RESETHAND) next_segv.sa_handler = SIG_DFL;
    if (next.sa_flags & SA_SIGINFO)
        next.sa_sigaction(sig, info, context);
    else
        next.sa_handler(sig);
}

static void on_segv(int sig, siginfo_t *info, void *context) {
    ucontext_t *uc = context;
    unsigned char *ip = (unsigned char *)uc->uc_mcontext.gregs[REG_RIP];
    /* CPUID faulting raises #GP: SI_KERNEL, at an instruction the CPU fetched (so readable) */
    if (info->si_code == SI_KERNEL && ip[0] == 0x0F && ip[1] == 0xA2) {
        unsigned leaf = (unsigned)uc->uc_mcontext.gregs[REG_RAX], sub = (unsigned)uc->uc_mcontext.gregs[REG_RCX];
        unsigned a, b, c, d;
        set_faulting(0);
        __cpuid_count(leaf, sub, a, b, c, d);
        set_faulting(1);
        hide(leaf, sub, &a, &b, &c, &d);
        uc->uc_mcontext.gregs[REG_RAX] = a;
        uc->uc_mcontext.gregs[REG_RBX] = b;
        uc->uc_mcontext.gregs[REG_RCX] = c;
        uc->uc_mcontext.gregs[REG_RDX] = d;
        uc->uc_mcontext.gregs[REG_RIP] += 2;
        return;
    }
    chain(sig, info, context);
}

/* The program sets its SIGSEGV handler through these: it is kept as the next handler, ours stays first. */
int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
    if (!real_sigaction) real_sigaction = dlsym(RTLD_NEXT, "sigaction");
    if (sig != SIGSEGV || kind == HOST) return real_sigaction(sig, act, old);
    if (old) *old = next_segv;
    if (act) next_segv = *act;
    return 0;
}

sighandler_t signal(int sig, sighandler_t handler) {
    struct sigaction act, old;
    memset(&act, 0, sizeof act);
    act.sa_handler = handler;
    act.sa_flags = SA_RESTART;
    if (sigaction(sig, &act, &old) != 0) return SIG_ERR;
    return old.sa_handler;
}

/* A thread that blocks SIGSEGV and then runs CPUID would be killed: the kernel forces a blocked synchronous signal,
 * resetting its handler to the default (OpenVINO's GPU and NPU plugins start such threads). SIGSEGV is never blocked. */
static int unblocked(int (*real)(int, const sigset_t *, sigset_t *), int how, const sigset_t *set, sigset_t *old) {
    if (kind != HOST && set && how != SIG_UNBLOCK && sigismember(set, SIGSEGV) == 1) {
        sigset_t copy = *set;
        sigdelset(&copy, SIGSEGV);
        return real(how, &copy, old);
    }
    return real(how, set, old);
}

int pthread_sigmask(int how, const sigset_t *set, sigset_t *old) {
    static int (*real)(int, const sigset_t *, sigset_t *);
    if (!real) real = dlsym(RTLD_NEXT, "pthread_sigmask");
    return unblocked(real, how, set, old);
}

int sigprocmask(int how, const sigset_t *set, sigset_t *old) {
    static int (*real)(int, const sigset_t *, sigset_t *);
    if (!real) real = dlsym(RTLD_NEXT, "sigprocmask");
    return unblocked(real, how, set, old);
}

__attribute__((constructor)) static void start(void) {
    const char *wanted = getenv("EDGELINE_CPU_KIND");
    real_sigaction = dlsym(RTLD_NEXT, "sigaction");
    if (!wanted || !real_sigaction) return;
    if (!strcmp(wanted, "avx2"))
        kind = AVX2;
    else if (!strcmp(wanted, "avx512-vnni"))
        kind = AVX512_VNNI;
    else if (!strcmp(wanted, "avx512-vnni-bf16"))
        kind = AVX512_VNNI_BF16;
    else
        return;
    amd = getenv("EDGELINE_CPU_VENDOR") && !strcmp(getenv("EDGELINE_CPU_VENDOR"), "amd");
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_segv;
    ours.sa_flags = SA_SIGINFO | SA_RESTART; /* not SA_ONSTACK: see the header */
    sigemptyset(&ours.sa_mask);
    if (real_sigaction(SIGSEGV, &ours, &next_segv) != 0 || syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) != 0) {
        real_sigaction(SIGSEGV, &next_segv, NULL); /* no CPUID faulting here: nothing hidden */
        kind = HOST;
    }
}
