"""The code reward's sandbox. A policy is an optimiser pointed at its grader, so the program it writes is hostile: no
code of the program runs where its verdict is decided. The promises, each with what enforces it:
  verdict   The row's tests run in the warden (A), the program in a process of its own (C), which answers the tests'
            requests (judge.py: both sides). Data and standard-library values cross as JSON that A decodes and
            rebuilds itself; any other object stays in C behind a handle, and what the tests do to it is a request
            whose answer is data again. A decides ==, and an operator between the program's object and the tests'
            data is refused (the program would see the expected value). C is forked before the tests are read: they
            never were in its memory, nor is the verdict. Each request carries a fresh nonce, repeated in its answer.
  hacks     A program that ends before or during its tests, a message that C's harness does not send (answers sent
            before they were asked among them), a system call the filter kills, an object whose own __eq__ claims a
            value the tests did not get: 0, the mark named ("hack: ..."), whatever the tests catch.
  rows      A check(candidate) row needs its entry point, and tests must call what a program could define (checked
            as the data is read, code_rows.row_tests); tests that pass with no call are an error. A HumanEval row's
            helpers (poly) are its prompt's, run in A, not the program's.
  texts     Whatever of the program's reaches a verdict (names, messages) is cut to a few hundred printable
            characters (judge.clean).
  files     Mount namespace: a read-only root of /usr and the libraries, /dev/null and kin, a tmpfs /tmp of file_mb
            (the only writable place); no /proc, home, project or machine files.
  network   Network namespace, its loopback down; seccomp: sockets of AF_UNIX alone (no vsock, netlink, packet).
  processes PID namespace, C its init: it sees no other process; seccomp: no fork, vfork or clone of a process
            (threads only), no ptrace, process_vm_*, pidfd_getfd, namespace or mount.
  memory    One process, so RLIMIT_AS (mem_mb) bounds all of the program's memory, its threads' too; seccomp: no
            memory files (memfd), SysV shared memory or queues, POSIX queues, io_uring; its files: file_mb in /tmp.
            What the kernel holds for it outside its address space stays small: no vmsplice (pages pinned in a
            pipe), no pipe grown, no socket buffer set, no sendmsg (no descriptor in flight); 64 descriptors.
  keyring   seccomp: no add_key, request_key or keyctl: nothing passes to the next program, or to the caller.
  time      RLIMIT_CPU (cpu_s) in C; the wall time (wall_s) over the row's runs, A's timer, then C killed; a run
            with no time left is over at once.
  privilege User namespace, its uid mapped (not root there), no capability, no_new_privs; a root caller's programs
            run as nobody (RLIMIT_NPROC does not bind root). A confines itself as well once it has forked C.
The processes: Z, the zygote (/usr/bin/python3 -I -S, one per calling process, an empty environment), forks A per
run and never reads a request, so that no row's tests stay in memory that a later program is forked from. A reads
the program's part of the request, splices the tests' part into a memory file, enters the namespaces, forks C,
confines itself, judges and answers. C confines itself, runs the program (a stdin/stdout row: on its input; the
caller compares its output), then answers A's calls. Not isolated (--weak-sandbox, where the machine has no user
namespaces), A skips the namespaces: C runs in a temporary directory, under the rlimits and the filter alone, this
user's files and processes in its reach."""
import contextlib
import ctypes
import fcntl
import functools
import gc
import json
import os
import resource
import select
import signal
import struct
import sys

if __name__ == "__main__":  # the zygote (python3 -I: no directory of scripts on its path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
else:  # the caller's: the rows' formats (the zygote, without them, forks faster)
    import code_rows  # noqa: F401  (beside this file)
import judge  # noqa: E402  (the call boundary's two sides, beside this file)

LIMITS = {"cpu_s": 5, "wall_s": 8.0, "row_s": 30.0, "mem_mb": 512, "procs": 64, "file_mb": 16, "out_kb": 16384,
          "msg_mb": 64}  # (row_s: the wall time of a row's runs together, each run wall_s at most)
NOBODY, PYTHON = 65534, "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
RDONLY, NOSUID, NODEV, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 4, 24, 38, 22
CALLS = {  # the kernel's numbers. Denied (x86_64's order): fork vfork ptrace process_vm_readv/writev pidfd_getfd
    # add_key request_key keyctl unshare setns mount umount2 pivot_root chroot memfd_create memfd_secret io_uring_*
    # userfaultfd bpf perf_event_open shmget msgget semget mq_open kexec_load kexec_file_load init/finit_module
    # open_by_handle_at; vmsplice (pins pages in a pipe), sendmsg and sendmmsg (file descriptors in flight, each
    # holding its buffers) (aarch64 has no fork, vfork, kexec_file_load)
    "x86_64": dict(arch=0xC000003E, pivot_root=155, capset=126, clone=56, socket=41, socketpair=53, prctl=157,
                   fcntl=72, setsockopt=54,
                   denied=[57, 58, 101, 310, 311, 438, 248, 249, 250, 272, 308, 165, 166, 155, 161, 319, 447, 425,
                           426, 427, 323, 321, 298, 29, 68, 64, 240, 246, 320, 175, 313, 304, 278, 46, 307]),
    "aarch64": dict(arch=0xC00000B7, pivot_root=41, capset=91, clone=220, socket=198, socketpair=199, prctl=167,
                    fcntl=25, setsockopt=208,
                    denied=[117, 270, 271, 438, 217, 218, 219, 97, 268, 40, 39, 41, 51, 279, 447, 425, 426, 427, 282,
                            280, 241, 194, 186, 190, 180, 104, 105, 273, 265, 75, 211, 269])}
SYS = CALLS.get(os.uname().machine)
libc = ctypes.CDLL(None, use_errno=True)


class SandboxError(Exception):
    """The sandbox failed, a program hit a limit, or its row cannot be graded: 0, counted as a grading error."""


def verdict(code, row, spec=None, **limits):
    """(reward, verdict) of a program on its row: (1.0, "passed"), else 0.0 and why not ("hack: ..." a hack's mark).
    SandboxError where a run hit a limit, the sandbox failed, or the row cannot be graded. Outputs are compared as
    the row's set compares them (code_rows.same_output); each input a run, until one fails."""
    spec = spec or code_rows.row_tests(row)  # (code_rows.row_tests's, where the caller has it)
    if isinstance(spec, str):
        raise SandboxError(f"the row cannot be graded: {spec}")
    lim = {**LIMITS, **limits}
    end = os.times().elapsed + lim["row_s"]  # (the row's runs share its wall time)
    for k, (stdin, want) in enumerate(zip(spec["ins"] or [None], spec["outs"] or [None])):
        left = end - os.times().elapsed
        if left <= 0:  # (a run with no time left is over at once: the warden's timer is never set to zero)
            raise SandboxError("over the wall time")
        r = run(code, spec, stdin, isolated(), **{**limits, "wall_s": min(lim["wall_s"], left)})
        if not r["ok"] or stdin is not None and not code_rows.same_output(r["out"], want, spec["compare"]):
            return 0.0, judge.clean(r["reason"] or f"wrong output on input {k + 1} of {len(spec['ins'])}")
    return 1.0, "passed"


def _mount(src, target, fstype, flags, data=None):
    _check(libc.mount(*(s and s.encode() for s in (src, target, fstype)), flags, data and data.encode()),
           f"mount {target}")


def _check(ret, what):
    if ret != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def _isolate(file_mb):
    """A: new user, mount, PID (for its children), network, IPC and UTS namespaces; the root a read-only tmpfs, mounted
    over /tmp there (the machine's /tmp is left as it is), holding read-only binds of what the interpreter needs,
    /dev's harmless devices and a writable tmpfs /tmp of file_mb; the machine's root detached."""
    uid, gid = os.getuid(), os.getgid()
    if SYS is None:
        raise OSError(f"no system call numbers for {os.uname().machine} (the seccomp filter)")
    _check(libc.unshare(NEWUSER | NEWNS | NEWPID | NEWNET | NEWIPC | NEWUTS), "unshare (user namespaces)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    _mount(None, "/", None, REC | PRIVATE)
    root = "/tmp"
    _mount("tmpfs", root, "tmpfs", NOSUID | NODEV, "mode=0755,size=1m")
    for path in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", sys.base_prefix):
        if os.path.islink(path):
            os.symlink(os.readlink(path), root + path)
        elif os.path.isdir(path) and not os.path.exists(root + path):
            os.makedirs(root + path)
            _mount(path, root + path, None, BIND | REC)
            _mount(None, root + path, None, REMOUNT | BIND | RDONLY | NOSUID | NODEV)
    os.mkdir(root + "/dev")
    for dev in ("null", "zero", "random", "urandom"):
        open(f"{root}/dev/{dev}", "w").close()
        _mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, BIND)
    os.mkdir(root + "/tmp")
    _mount("tmpfs", root + "/tmp", "tmpfs", NOSUID | NODEV, f"mode=0777,size={file_mb}m")
    _mount(None, root, None, REMOUNT | RDONLY | NOSUID | NODEV)
    os.chdir(root)
    _check(libc.syscall(SYS["pivot_root"], b".", b"."), "pivot_root")  # the old root now lies on top of the new one:
    _check(libc.umount2(b".", 2), "umount old root")  # MNT_DETACH, and it is gone
    os.chdir("/tmp")


def _seccomp():
    """The filter, in classic BPF: another machine's calls kill; a denied call EPERM; clone3 ENOSYS (threads fall back
    to clone); clone for a thread alone, no CLONE_NEW*; socket and socketpair of AF_UNIX alone (else EAFNOSUPPORT);
    prctl(PR_SET_PDEATHSIG) EPERM, so that C dies with A; no pipe grown (fcntl F_SETPIPE_SZ), no socket buffer set
    (SO_SNDBUF, SO_RCVBUF and their FORCE): the kernel's memory for a program's pipes and sockets stays small."""
    ld, ret, jeq = (lambda k: (0x20, 0, 0, k)), (lambda k: (6, 0, 0, k)), (lambda k, t, f: (0x15, t, f, k))
    allow, eperm, enosys, eafnosupport = 0x7FFF0000, 0x50001, 0x50026, 0x50061
    prog = [ld(4), jeq(SYS["arch"], 1, 0), ret(0x80000000), ld(0), (0x35, 0, 1, 0x40000000), ret(enosys)]  # (x32)
    for nr in SYS["denied"]:
        prog += [jeq(nr, 0, 1), ret(eperm)]
    prog += [jeq(435, 0, 1), ret(enosys), jeq(SYS["clone"], 0, 5), ld(16), (0x45, 2, 0, 0x7E020000),
             (0x45, 0, 1, 0x10000), ret(allow), ret(eperm)]  # (jset: a CLONE_NEW* flag, then CLONE_THREAD)
    for nr, at, arg, yes, no in ((SYS["socket"], 16, 1, allow, eafnosupport), (SYS["prctl"], 16, 1, eperm, allow),
                                 (SYS["socketpair"], 16, 1, allow, eafnosupport),
                                 (SYS["fcntl"], 24, 1031, eperm, allow)):
        prog += [jeq(nr, 0, 4), ld(at), jeq(arg, 0, 1), ret(yes), ret(no)]
    prog += [jeq(SYS["setsockopt"], 0, 9), ld(24), jeq(1, 0, 6), ld(32), jeq(7, 3, 0), jeq(8, 2, 0), jeq(32, 1, 0),
             jeq(33, 0, 1), ret(eperm), ret(allow)]  # (SOL_SOCKET: SO_SNDBUF, SO_RCVBUF, their FORCE)
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog + [ret(allow)])


FILTER = ctypes.create_string_buffer(_seccomp() if SYS else b"")  # (made once, in the zygote: fewer pages per fork)
FPROG = struct.pack("HxxxxxxP", len(FILTER.raw) // 8, ctypes.addressof(FILTER))  # struct sock_fprog


def _confine(lim, judge=False):
    """C, and A once it has forked C: no capability (the user namespace gave a full set), none to regain; the rlimits
    (A's time is the wall time); the filter."""
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    libc.syscall(SYS["capset"], (0x20080522).to_bytes(4, "little") + bytes(4), bytes(24)) if SYS else None
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for res, n in ((resource.RLIMIT_AS, lim["mem_mb"] + judge * 16 * lim["msg_mb"] << 20),  # (A reads messages)
                   (resource.RLIMIT_NPROC, lim["procs"] + 3), (resource.RLIMIT_CORE, 0),
                   (resource.RLIMIT_FSIZE, max(lim["file_mb"] << 20, lim["out_kb"] << 10) + 1),
                   (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_MSGQUEUE, 0), (resource.RLIMIT_CPU, lim["cpu_s"])):
        if res != resource.RLIMIT_CPU or not judge:  # (CPU: SIGXCPU, then SIGKILL a second later; within the caller's)
            hard = resource.getrlimit(res)[1]
            resource.setrlimit(res, tuple(int(x if hard == resource.RLIM_INFINITY else min(x, hard))
                                          for x in (n, n + (res == resource.RLIMIT_CPU))))
    _check(libc.prctl(PR_SET_SECCOMP, 2, FPROG, 0, 0) if SYS else 0, "seccomp")


def _program(job, out, calls, answers):
    """C: stdin (a memory file), stdout (with a stdin row a memory file, else /dev/null), fd 3 from A, fd 4 to A,
    nothing else open; confined; then the program and its side of the call boundary (judge.serve)."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # A gone: C dies
    os.setpgid(0, 0)  # (a group of its own: a signal to its group reaches no one else)
    stdin, null, io = os.memfd_create("stdin"), os.open("/dev/null", os.O_RDWR), job["stdin"] is not None
    os.write(stdin, (job["stdin"] or "").encode())
    os.lseek(stdin, 0, 0)
    for k, fd in enumerate([fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for fd in (stdin, out if io else null, null, calls,
                                                                           answers)]):
        os.dup2(fd, k)
    os.closerange(5, 1 << 16)
    _confine(job["limits"])
    judge.serve(job["code"], io, job["limits"]["msg_mb"] << 20, job["prompt"])


def _warden(isolated):
    """A: the request from fd 0, the tests' part spliced into a memory file (so never in A's memory when it forks C);
    the namespaces; C; confined, the verdict within the wall time; the answer on fd 1. C's output is a memory file
    that A reads once C is gone: a flood (bounded by the file-size limit) costs A only the bytes it reads."""
    job = json.loads(judge.read(0, int.from_bytes(judge.read(0, 8), "little")))
    spec, n = os.memfd_create("tests"), int.from_bytes(judge.read(0, 8), "little")
    while n:
        n -= os.splice(0, spec, n)
    lim, out, late = job["limits"], os.memfd_create("out"), []
    try:
        with contextlib.nullcontext() if isolated else __import__("tempfile").TemporaryDirectory(  # (the zygote,
                ignore_cleanup_errors=True) as cwd:  # without tempfile and what it imports, forks faster)
            _isolate(lim["file_mb"]) if isolated else os.chdir(cwd)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # Z gone: A, then C, die (unshare cleared it)
            calls, answers = os.pipe(), os.pipe()
            c = os.fork()
            if c == 0:
                try:  # (whatever the program does, C ends here: it never returns into A's code)
                    _program(job, out, calls[0], answers[1])
                finally:
                    os._exit(0)
            os.close(calls[0])
            os.close(answers[1])
            _confine(lim, judge=True)
            libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # (after the rlimits, whose change of credentials resets it)
            signal.signal(signal.SIGALRM, functools.partial(_late, late))
            signal.setitimer(signal.ITIMER_REAL, max(lim["wall_s"], 0.001), 0.05)  # (and again, till the tests stop)
            with contextlib.suppress(judge.Stop):
                try:
                    said = judge.judge(json.loads(os.pread(spec, os.fstat(spec).st_size, 0)), job["stdin"] is not None,
                                       c, calls[1], answers[0], lim["msg_mb"] << 20, lim["cpu_s"])
                finally:  # (no alarm after this: a late one would stop A itself)
                    signal.signal(signal.SIGALRM, signal.SIG_IGN)
                    signal.setitimer(signal.ITIMER_REAL, 0)
            with contextlib.suppress(ProcessLookupError, ChildProcessError):  # (isolated, C is init: all its die)
                os.kill(c, signal.SIGKILL)
                os.waitpid(c, 0)
        said, printed = {"error": "over the wall time"} if late else said, os.pread(out, (lim["out_kb"] << 10) + 1, 0)
        why = said.get("error") or (f"the program wrote over {lim['out_kb']} KB" if len(printed) > lim["out_kb"] << 10
                                    else None)
        answer = {"ok": bool(said.get("passed")) and why is None, "out": printed.decode(errors="replace"),
                  "why": why, "reason": said.get("why")}
    except Exception as e:  # noqa: BLE001  (a failure of the sandbox itself, reported to the caller)
        answer = {"ok": False, "out": "", "why": f"sandbox: {type(e).__name__}: {e}", "reason": None}
    os.write(1, json.dumps(answer).encode() + b"\n")


def _late(late, *_):
    late.append(True)
    raise judge.Stop


def _zygote(isolated):
    """Z: a root caller's becomes nobody; forks a warden per request (it reads the request itself) until the caller
    is gone."""
    if os.getuid() == 0:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # (a changed uid made /proc/self root's: the maps need it ours)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # (after the change of uid, which clears it)
    gc.collect()
    libc.malloc_trim(0)  # (what compiling judge.py left in the heap goes back: fewer pages for each fork to map)
    gc.freeze()  # the forks' garbage collections leave the zygote's objects alone: fewer pages copied per program
    requests = select.poll()
    requests.register(0, select.POLLIN)
    while requests.poll()[0][1] & select.POLLIN:  # (the caller gone and nothing to read: POLLHUP alone)
        if os.fork() == 0:
            try:
                _warden(isolated)
            finally:
                os._exit(0)
        os.wait()  # (A has read its request when it ends)


ZYGOTES = {}  # (this process's pid, isolated): its zygote, started at its first program


def run(code, spec=None, stdin=None, isolated=True, **limits):
    """One run of a program: with stdin, {"ok": it ran to its end, "out": its output}; else (None) against its tests
    (spec: code_rows.row_tests's), {"ok": it passed, "reason": why not ("hack: ..." for a hack's mark)}. SandboxError
    where it hit a limit or the sandbox failed. `isolated` False runs it without the namespaces."""
    import subprocess  # (here, not at the top: the zygote, a megabyte smaller without it, forks faster)
    limits, key = {**LIMITS, **limits}, (os.getpid(), isolated)
    if key not in ZYGOTES or ZYGOTES[key].poll() is not None:
        ZYGOTES[key] = subprocess.Popen([PYTHON, "-I", "-S", "-B", os.path.abspath(__file__), str(isolated)], env={},
                                        cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    spec = spec or {"prompt": None}
    zygote, parts = ZYGOTES[key], (dict(code=code, stdin=stdin, limits=limits, prompt=spec["prompt"]), spec)
    try:
        zygote.stdin.write(b"".join(len(m).to_bytes(8, "little") + m for m in map(str.encode, map(json.dumps, parts))))
        zygote.stdin.flush()
        ready = select.select([zygote.stdout], [], [], limits["wall_s"] + 10)[0]
        answer = json.loads(zygote.stdout.readline() or "null") if ready else None
    except OSError:
        answer = None
    if answer is None:  # (a new zygote starts at the next program)
        os.killpg(zygote.pid, signal.SIGKILL)
        zygote.wait()
    if answer is None or answer["why"]:
        raise SandboxError(judge.clean(answer["why"]) if answer else "the sandbox did not answer")
    return answer


@functools.lru_cache(None)
def missing():
    """What the machine lacks for the isolation (a line), or '' when programs can run isolated."""
    try:
        return run("pass", stdin="", wall_s=30) and ""
    except SandboxError as e:
        return str(e)


def isolated():
    """Whether programs run isolated: yes, unless SCALERL_WEAK_SANDBOX=1 (--weak-sandbox) accepts a machine that
    cannot isolate them."""
    return os.environ.get("SCALERL_WEAK_SANDBOX") != "1" or not missing()


if __name__ == "__main__":
    _zygote(sys.argv[1] == "True")
