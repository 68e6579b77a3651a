"""Runs untrusted Python programs against their tests, for --reward code. Each program gets fresh Linux namespaces
(user, mount, network, PID, IPC, UTS) entered with unshare(2) through ctypes, and rlimits: standard library only, it
imports without torch and needs no system package (why not bubblewrap: docs/data-and-rewards.md). Per calling process:
  Z, the zygote: /usr/bin/python3 started once with an empty environment in a session of its own; a root caller's
     becomes nobody (RLIMIT_NPROC does not bind root). Forks A per run and never reads a request itself, so that no
     row's tests stay in the memory a later program is forked from.
  A, the warden: reads the request; enters the namespaces (its own uid mapped: not root there), whose root is
     read-only (/usr, /dev/null and kin, a size-limited tmpfs /tmp: the only writable place, gone with them; no home,
     no project, no machine files) and the network a loopback that is down; drops every capability; forks C; kills
     it at the wall time; reports what C printed and whether it completed.
  C, the program: PID 1 of its namespace, so that every process it made dies with it (daemons too) and none can
     signal a process outside. Under rlimits, it runs the program, its tests in the same interpreter, then writes a
     token known to A and C only: a program that ends early (sys.exit, os._exit, a swallowed exception) cannot pass.
     (A program that reads the harness's frames could find it: in-process asserts cannot be made unforgeable;
     stdin/stdout tests, compared outside the sandbox, are.)
Not isolated (--weak-sandbox), A skips the namespaces: C runs in a temporary directory under the rlimits only."""
import builtins
import contextlib
import ctypes
import functools
import gc
import json
import os
import resource
import select
import signal
import sys
import tempfile

LIMITS = {"cpu_s": 5, "wall_s": 8.0, "mem_mb": 512, "procs": 16, "file_mb": 16, "out_kb": 1024}
NOBODY = 65534
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
RDONLY, NOSUID, NODEV, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
SYS_PIVOT_ROOT, SYS_CAPSET = {"x86_64": (155, 126), "aarch64": (41, 91)}.get(os.uname().machine, (-1, -1))
libc = ctypes.CDLL(None, use_errno=True)


class SandboxError(Exception):
    """The sandbox failed, or a program hit one of its limits: the completion scores 0, counted as a grading error."""


def row_tests(row):
    """(tests, entry_point, inputs, outputs) of a code row, or a string: why it has none. tests/test/test_list: Python
    run after the program (MBPP's asserts; HumanEval's `def check(candidate)`, called with the row's entry_point);
    inputs/outputs: stdin and expected stdout (APPS, CodeContests, LiveCodeBench); input_output: those as JSON."""
    t = next(filter(None, map(row.get, ("tests", "test", "test_list"))), None)
    t = "\n".join(t) if isinstance(t, list) and all(isinstance(s, str) for s in t) else t
    if isinstance(t, str) and t.strip():
        entry = row.get("entry_point") if "def check(" in t else None
        return (t, entry, None, None) if entry is None or str(entry).isidentifier() else (
            f"'entry_point' {entry!r} is not a function name, for the tests' check(candidate)")
    io = row.get("input_output", row)
    with contextlib.suppress(TypeError, ValueError):
        io = json.loads(io)
    ins, outs = (io.get(k) if isinstance(io, dict) else None for k in ("inputs", "outputs"))
    if not (isinstance(ins, list) and isinstance(outs, list) and ins and len(ins) == len(outs)
            and all(isinstance(s, str) for s in ins + outs)):
        return "no tests: 'tests', 'test' or 'test_list', or 'inputs' and 'outputs' (or 'input_output'), as strings"
    return None, None, ins, outs


def passes(code, row, **limits):
    """Whether the program passes every test of its row; SandboxError when a run hit a limit or the sandbox failed.
    Outputs are compared line by line, trailing whitespace (and trailing empty lines) ignored."""
    tests, entry, ins, outs = row_tests(row)
    lines = lambda text: [s.rstrip() for s in text.rstrip().splitlines()]  # noqa: E731
    end = os.times().elapsed + {**LIMITS, **limits}["wall_s"]  # (the row's runs share its wall time)
    runs = ((run(code, tests, entry, stdin, isolated(), **{**limits, "wall_s": max(0.0, end - os.times().elapsed)}),
             stdin, want) for stdin, want in zip(ins or [None], outs or [None]))  # (one at a time, until one fails)
    return all(r["ok"] and (stdin is None or lines(r["out"]) == lines(want)) for r, stdin, want in runs)


def _check(ret, what):
    if ret != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def _mount(src, target, fstype, flags, data=None):
    _check(libc.mount(*(s and s.encode() for s in (src, target, fstype)), flags, data and data.encode()),
           f"mount {target}")


def _isolate(file_mb):
    """A: new user, mount, PID (for its children), network, IPC and UTS namespaces; the root a read-only tmpfs, mounted
    over /tmp there (the machine's /tmp is left as it is), holding read-only binds of what the interpreter needs,
    /dev's harmless devices and a writable tmpfs /tmp of file_mb; the machine's root detached; no capability left."""
    uid, gid = os.getuid(), os.getgid()
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
    _check(libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")  # the old root now lies on top of the new one:
    _check(libc.umount2(b".", 2), "umount old root")  # MNT_DETACH, and it is gone
    os.chdir("/tmp")
    cap = 0  # no capability left (unshare gave a full set in the new user namespace), none to regain, no setuid
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    _check(libc.syscall(SYS_CAPSET, (0x20080522).to_bytes(4, "little") + bytes(4), bytes(24)), "capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _program(job, out, report, token):
    """C: a process group of its own (A kills it); stdin, stdout (a memory file; /dev/null with asserts), the report
    file as fd 3 and nothing else open; the rlimits; the program, then its tests in the same interpreter, then the
    token. The program's globals are its own; the harness's functions are taken first."""
    os.setpgid(0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # A gone: C dies
    fd, lim = os.memfd_create("stdin"), job["limits"]
    os.write(fd, (job["stdin"] or "").encode())
    os.lseek(fd, 0, 0)
    for src, dst in ((fd, 0), (out, 1), (os.open("/dev/null", os.O_WRONLY), 2), (report, 3)):
        os.dup2(src, dst)
    os.closerange(4, 1 << 16)
    for res, n in ((resource.RLIMIT_CPU, lim["cpu_s"]), (resource.RLIMIT_AS, lim["mem_mb"] << 20),
                   (resource.RLIMIT_NPROC, lim["procs"] + 3), (resource.RLIMIT_FSIZE, lim["file_mb"] << 20),
                   (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 64)):
        resource.setrlimit(res, (n, n + (res == resource.RLIMIT_CPU)))  # CPU: SIGXCPU, then SIGKILL a second later
    run, write, flush, g = exec, os.write, sys.stdout.flush, {"__name__": "__main__", "__builtins__": builtins}
    try:
        try:
            run(compile(job["code"], "solution.py", "exec"), g)
        except SystemExit as e:  # sys.exit() ends a stdin/stdout program well; with asserts, its tests did not run
            if job["stdin"] is None or e.code not in (None, 0):
                raise
        if job["tests"]:
            run(compile(job["tests"], "tests.py", "exec"), g)
        if job["entry"]:
            g["check"](g[job["entry"]])
        flush()
        write(3, token)
    except (MemoryError, BlockingIOError, RecursionError) as e:  # a limit hit: the grader counts it as an error
        write(3, b"!" + type(e).__name__.encode())
    finally:
        os._exit(0)


def _warden(isolated):
    """A: one request from fd 0, its answer on fd 1. C writes into memory files that A reads once C is gone: a flood
    (bounded by the file-size limit) costs A only the bytes it reads, and a process that C left (not isolated) holds
    no pipe for A to wait on. Not isolated, C's working directory is a temporary directory, removed at the end, and A
    kills C's process group: what did not leave it."""
    job, token = json.loads(sys.stdin.buffer.readline()), os.urandom(16).hex().encode()  # (one line: none read ahead)
    lim, out, report = job["limits"], os.memfd_create("out"), os.memfd_create("report")
    try:
        with contextlib.nullcontext() if isolated else tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as cwd:
            _isolate(lim["file_mb"]) if isolated else os.chdir(cwd)
            libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # (not isolated, the program could otherwise ptrace A)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # Z gone: A, then C, die (unshare cleared it)
            c = os.fork()
            if c == 0:
                _program(job, out if job["stdin"] is not None else os.open("/dev/null", os.O_WRONLY), report, token)
            os.setpgid(c, c)  # (as C does: whichever comes first, the kill below reaches C's group)
            in_time = select.select([os.pidfd_open(c)], [], [], lim["wall_s"])[0]
            with contextlib.suppress(ProcessLookupError):  # isolated, C is init: its namespace dies with it
                os.killpg(c, signal.SIGKILL)
            status = os.waitpid(c, 0)[1]
        printed, said, cap = os.pread(out, (lim["out_kb"] << 10) + 1, 0), os.pread(report, 64, 0), lim["out_kb"] << 10
        why = ("over the wall time" if not in_time else
               f"the program wrote over {lim['out_kb']} KB" if len(printed) > cap else
               f"the program was killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else
               f"the program hit a limit ({said[1:].decode(errors='replace')})" if said[:1] == b"!" else None)
        answer = {"ok": said == token and why is None, "out": printed.decode(errors="replace"), "why": why}
    except Exception as e:  # noqa: BLE001  (a failure of the sandbox itself, reported to the caller)
        answer = {"ok": False, "out": "", "why": f"sandbox: {e}"}
    os.write(1, json.dumps(answer).encode() + b"\n")


def _zygote(isolated):
    """Z: a root caller's becomes nobody; forks a warden per request (it reads the request itself) until the caller
    is gone."""
    if os.getuid() == 0:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # (a changed uid made /proc/self root's: the maps need it ours)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # (after the change of uid, which clears it)
    gc.freeze()  # the forks' garbage collections leave the zygote's objects alone: fewer pages copied per program
    requests = select.poll()
    requests.register(0, select.POLLIN)
    while requests.poll()[0][1] & select.POLLIN:  # (the caller gone and nothing to read: POLLHUP alone)
        if os.fork() == 0:
            _warden(isolated)
            os._exit(0)
        os.wait()  # (A has read its request when it ends)


ZYGOTES = {}  # (this process's pid, isolated): its zygote, started at its first program


def run(code, tests=None, entry=None, stdin=None, isolated=True, **limits):
    """One run of a program, given stdin or (None) with its output discarded: {"ok", "out", "why"}; SandboxError where
    it hit a limit or the sandbox failed. `isolated` False runs it with rlimits only."""
    import subprocess  # (here, not at the top: the zygote, a megabyte smaller without it, forks faster)
    limits, key = {**LIMITS, **limits}, (os.getpid(), isolated)
    if key not in ZYGOTES or ZYGOTES[key].poll() is not None:
        ZYGOTES[key] = subprocess.Popen([PYTHON, "-I", "-S", os.path.abspath(__file__), str(isolated)], env={},
                                        cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    zygote, job = ZYGOTES[key], dict(code=code, tests=tests, entry=entry, stdin=stdin, limits=limits)
    try:
        zygote.stdin.write(json.dumps(job).encode() + b"\n")
        zygote.stdin.flush()
        ready = select.select([zygote.stdout], [], [], limits["wall_s"] + 10)[0]
        answer = json.loads(zygote.stdout.readline() or "null") if ready else None
    except OSError:
        answer = None
    if answer is None:  # (a new zygote starts at the next program)
        os.killpg(zygote.pid, signal.SIGKILL)
        zygote.wait()
    if answer is None or answer["why"]:
        raise SandboxError(answer["why"] if answer else "the sandbox did not answer")
    return answer


@functools.lru_cache(None)
def missing():
    """What the machine lacks for the isolation (a line), or '' when programs can run isolated."""
    try:
        return run("pass", wall_s=30) and ""
    except SandboxError as e:
        return str(e)


def isolated():
    """Whether programs run isolated: yes, unless SCALERL_WEAK_SANDBOX=1 (--weak-sandbox) accepts a machine that
    cannot isolate them."""
    return os.environ.get("SCALERL_WEAK_SANDBOX") != "1" or not missing()


if __name__ == "__main__":
    _zygote(sys.argv[1] == "True")
