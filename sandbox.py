"""Runs untrusted Python programs against their tests, for --reward code. Each program gets fresh Linux namespaces
(user, mount, network, PID, IPC, UTS) entered with unshare(2) through ctypes, and rlimits: standard library only, it
imports without torch and needs no system package (why not bubblewrap: docs/data-and-rewards.md). Per calling process:
  Z, the zygote: /usr/bin/python3 started once with an empty environment in a session of its own; forks A per program
     and never reads a request itself, so that no row's tests stay in the memory a later program is forked from.
  A, the warden: reads the request; a root caller becomes nobody (RLIMIT_NPROC does not bind root); makes the temporary
     directory, enters the namespaces (its own uid mapped: not root there), forks B, kills it at the wall time.
  B, the harness: PID 1 of the namespace, so that killing it kills every process the program made (daemons too).
     Mounts a read-only root (/usr, /dev/null and kin, a size-limited tmpfs /tmp: the only writable place; no home, no
     project, no machine files), drops every capability, forks C per run and reports what each printed and completed.
  C, the program, under rlimits: the program, its tests in the same interpreter, then a token known to B and C only,
     on a pipe of B's: a program that ends early (sys.exit, os._exit, a swallowed exception) cannot pass. (A program
     that reads the harness's frames could find it: in-process asserts cannot be made unforgeable; stdin/stdout tests,
     compared outside the sandbox, are.) The network namespace has only a loopback that is down: no network; signals
     cannot name a process outside the PID namespace."""
import builtins
import contextlib
import ctypes
import functools
import json
import os
import resource
import select
import shutil
import signal
import subprocess
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
    for t in (row.get(key) for key in ("tests", "test", "test_list")):
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


def same_output(out, expected):
    """stdout compared line by line, trailing whitespace (and trailing empty lines) ignored."""
    return [s.rstrip() for s in out.rstrip().splitlines()] == [s.rstrip() for s in expected.rstrip().splitlines()]


def passes(code, row, **limits):
    """Whether the program passes every test of its row; SandboxError when it hit a limit or the sandbox failed."""
    tests, entry, ins, outs = row_tests(row)
    runs = sandbox().run(code, tests, entry, ins, **limits)
    return all(r["ok"] for r in runs) and (ins is None or all(map(same_output, [r["out"] for r in runs], outs)))


def _check(ret, what):
    if ret != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def _mount(src, target, fstype, flags, data=None):
    _check(libc.mount(*(s and s.encode() for s in (src, target, fstype)), flags, data and data.encode()),
           f"mount {target}")


def _enter_namespaces():
    """A: new user, PID, network, IPC and UTS namespaces; the mount namespace is B's, so that A keeps the machine's."""
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(NEWUSER | NEWPID | NEWNET | NEWIPC | NEWUTS), "unshare (user namespaces)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _enter_root(root, file_mb):
    """B: a new mount namespace whose root is a read-only tmpfs holding read-only binds of what the interpreter needs,
    /dev's harmless devices and a writable tmpfs /tmp of file_mb; the machine's root is detached. Then B drops its
    capabilities."""
    _check(libc.unshare(NEWNS), "unshare (mount namespace)")
    _mount(None, "/", None, REC | PRIVATE)
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
    _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")  # no process of the program may ptrace B


def _program(job, stdin, out_w, rep_w, token):
    """C: stdin, stdout, the report pipe as fd 3 and nothing else open, the rlimits; the program, then its tests in the
    same interpreter, then the token. The program's globals are its own; the harness's functions are taken first."""
    fd, lim = os.memfd_create("stdin"), job["limits"]
    os.write(fd, stdin.encode())
    os.lseek(fd, 0, 0)
    for src, dst in ((fd, 0), (out_w, 1), (os.open("/dev/null", os.O_WRONLY), 2), (rep_w, 3)):
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
            if job["inputs"] is None or e.code not in (None, 0):
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


def _kill_rest(c):
    """B: kill every process but itself (B is the PID namespace's init), reaping them; not isolated: C alone (A kills
    the rest, B's process group, at the end)."""
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        while os.getpid() == 1:
            os.kill(-1, signal.SIGKILL)  # every process of the namespace but init
            os.waitpid(-1, 0)
        os.kill(c, signal.SIGKILL)


def _one_run(job, stdin, cap):
    """B: one run of the program in C; what it printed (up to `cap` bytes) and whether it completed."""
    token, (out_r, out_w), (rep_r, rep_w) = os.urandom(16).hex().encode(), os.pipe(), os.pipe()
    c = os.fork()
    if c == 0:
        os.close(out_r), os.close(rep_r)
        _program(job, stdin, out_w if job["inputs"] else os.open("/dev/null", os.O_WRONLY), rep_w, token)
    os.close(out_w), os.close(rep_w)
    out, rep, fds, why = bytearray(), bytearray(), [out_r, rep_r], None
    pidfd = done = os.pidfd_open(c)
    while fds or done > 0:  # (both pipes may be closed before C is gone)
        ready = select.select(fds + [done] * (done > 0), [], [])[0]
        if done in ready:
            status, done = os.waitpid(c, 0)[1], -1
            _kill_rest(c)  # the program's other processes end with it, and with them the pipes they may hold open
            why = f"the program was killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else None
        for fd in set(ready) & set(fds):
            data = os.read(fd, 1 << 16)
            (out if fd == out_r else rep).extend(data)
            fds.remove(fd) if not data else None
        del rep[64:]  # (a fork bomb's processes may each write there)
        if len(out) > cap:
            why = f"the program wrote over {cap >> 10} KB"
            _kill_rest(c)
            break
    why = why or (rep[:1] == b"!" or None) and f"the program hit a limit ({rep[1:].decode(errors='replace')})"
    for fd in (out_r, rep_r, pidfd):
        os.close(fd)
    return {"ok": rep == token and why is None, "out": out.decode(errors="replace"), "why": why}


def _harness(job, root, report_w):
    """B: sets up the root if isolated, then runs the program once (asserts) or once per input; the runs to A."""
    if job["isolated"]:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # A gone: B and its namespace die
        _enter_root(root, job["limits"]["file_mb"])
    else:
        os.setsid()  # a process group for A to kill at the end: C, and what it made that did not leave it
        os.chdir(root)
    runs, cap = [], job["limits"]["out_kb"] << 10
    for stdin in job["inputs"] or [""]:
        runs.append(_one_run(job, stdin, cap - sum(len(r["out"]) for r in runs)))
        if runs[-1]["why"]:
            break
    os.write(report_w, json.dumps(runs).encode())


def _warden():
    """A: one request from fd 0 (None: the caller is gone), its answer on fd 1."""
    line = sys.stdin.buffer.readline()  # (one request at a time: nothing read ahead is lost)
    if not line:
        os._exit(3)
    job = json.loads(line)
    if os.getuid() == 0:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # (a changed uid made /proc/self root's: the maps need it ours)
    root = tempfile.mkdtemp(prefix="sandbox-")
    try:
        if job["isolated"]:
            _enter_namespaces()
        r, w = os.pipe()
        b = os.fork()
        if b == 0:
            os.close(r)
            try:
                _harness(job, root, w)
            finally:
                os._exit(0)
        os.close(w)
        report, data, deadline = bytearray(), None, os.times().elapsed + job["limits"]["wall_s"]
        while select.select([r], [], [], max(0.0, deadline - os.times().elapsed))[0]:
            data = os.read(r, 1 << 16)
            if not data:
                break
            report.extend(data)
        with contextlib.suppress(ProcessLookupError):  # the namespace dies with B; not isolated, B's process group
            (os.kill if job["isolated"] else os.killpg)(b, signal.SIGKILL)
        os.waitpid(b, 0)
        answer = json.loads(report) if data == b"" and report else {"error": "over the wall time"}
    except Exception as e:  # noqa: BLE001  (a failure of the sandbox itself, reported to the caller)
        answer = {"error": f"sandbox: {e}"}
    finally:
        os.rmdir(root) if job["isolated"] else shutil.rmtree(root, ignore_errors=True)
    os.write(1, json.dumps(answer).encode() + b"\n")


def _zygote():
    """Z: forks a warden per request (it reads the request itself) until the caller is gone."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    while select.select([0], [], []):
        a = os.fork()
        if a == 0:
            _warden()
            os._exit(0)
        if os.waitstatus_to_exitcode(os.waitpid(a, 0)[1]) == 3:
            return


class Sandbox:
    """A zygote for this process, started at the first program; `isolated` False runs programs with rlimits only."""

    def __init__(self, isolated=True):
        self.isolated, self.zygote = isolated, None

    def run(self, code, tests=None, entry=None, inputs=None, **limits):
        """The runs of a program (one, or one per stdin input): {"ok", "out", "why"} each; SandboxError over a limit."""
        limits = {**LIMITS, **limits}
        if self.zygote is None or self.zygote.poll() is not None or self.pid != os.getpid():
            self.zygote, self.pid = subprocess.Popen([PYTHON, "-I", "-S", os.path.abspath(__file__)], env={},
                                                     cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                     start_new_session=True), os.getpid()
        job = dict(code=code, tests=tests, entry=entry, inputs=inputs, limits=limits, isolated=self.isolated)
        try:
            self.zygote.stdin.write(json.dumps(job).encode() + b"\n")
            self.zygote.stdin.flush()
            ready = select.select([self.zygote.stdout], [], [], limits["wall_s"] + 10)[0]
            answer = json.loads(self.zygote.stdout.readline() or "null") if ready else None
        except OSError:
            answer = None
        if answer is None:
            os.killpg(self.zygote.pid, signal.SIGKILL)
            self.zygote.wait()
            raise SandboxError("the sandbox did not answer")
        if isinstance(answer, dict):
            raise SandboxError(answer["error"])
        why = next((r["why"] for r in answer if r["why"]), None)
        if why:
            raise SandboxError(why)
        return answer


@functools.lru_cache(None)
def missing():
    """What the machine lacks for the isolation (a line), or '' when programs can run isolated."""
    try:
        Sandbox(isolated=True).run("pass", wall_s=30)
        return ""
    except SandboxError as e:
        return str(e)


def isolation():
    """Which isolation is in force here, for the run's start-up line."""
    return ("Linux namespaces (user, mount, network, PID, IPC, UTS) and rlimits" if sandbox().isolated else
            f"rlimits only, not isolated (--weak-sandbox; {missing()})")


@functools.lru_cache(None)
def sandbox():
    """This process's sandbox: isolated, or with rlimits only where SCALERL_WEAK_SANDBOX=1 (--weak-sandbox) accepts."""
    return Sandbox(isolated=os.environ.get("SCALERL_WEAK_SANDBOX") != "1" or not missing())


if __name__ == "__main__":
    _zygote()
