/*
 * Loaded into gdb (LD_PRELOAD) on x86-64 CPUs whose register state is larger than gdb knows.
 *
 * gdb saves a thread's registers before a call into the target and writes them back after it. On a
 * CPU with AMX (or any state component gdb predates), the kernel accepts the extended state only as
 * a buffer of its full size; gdb hands it a shorter one, the write fails ("Couldn't write extended
 * state status: Bad address") and the thread is left with the call's registers: the target dies.
 *
 * This wrapper completes gdb's buffer: it reads the thread's whole current state, lays gdb's bytes
 * over the components gdb knows, keeps the kernel's for the rest, and writes the full size. Every
 * other ptrace request passes through unchanged.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/types.h>
#include <sys/uio.h>

#define XSAVE_HEADER 512      /* offset of XSTATE_BV in the standard XSAVE layout */
#define KNOWN_COMPONENTS 0x2FFull /* x87, SSE, AVX, MPX, AVX-512, PKRU: what gdb 13 writes */

typedef long (*ptrace_fn)(int, pid_t, void *, void *);

long ptrace(enum __ptrace_request request, ...) {
    static ptrace_fn real;
    static unsigned char whole[1 << 16] __attribute__((aligned(64)));
    va_list args;
    va_start(args, request);
    pid_t pid = va_arg(args, pid_t);
    void *addr = va_arg(args, void *);
    void *data = va_arg(args, void *);
    va_end(args);
    if (!real)
        real = (ptrace_fn)dlsym(RTLD_NEXT, "ptrace");
    if (request == PTRACE_SETREGSET && (uintptr_t)addr == NT_X86_XSTATE && data != NULL) {
        struct iovec *given = (struct iovec *)data;
        struct iovec full = {whole, sizeof whole};
        if (given->iov_len > XSAVE_HEADER + 8 && real(PTRACE_GETREGSET, pid, addr, &full) == 0 &&
            full.iov_len > given->iov_len) {
            uint64_t kernel_bv, gdb_bv, merged;
            memcpy(&kernel_bv, whole + XSAVE_HEADER, sizeof kernel_bv);
            memcpy(&gdb_bv, (unsigned char *)given->iov_base + XSAVE_HEADER, sizeof gdb_bv);
            memcpy(whole, given->iov_base, given->iov_len);
            merged = (gdb_bv & KNOWN_COMPONENTS) | (kernel_bv & ~KNOWN_COMPONENTS);
            memcpy(whole + XSAVE_HEADER, &merged, sizeof merged);
            return real(PTRACE_SETREGSET, pid, addr, &full);
        }
    }
    return real(request, pid, addr, data);
}
