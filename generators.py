"""generators.py -- the generator-trainer split of scalerl.py (--generators N) [Sec. 2, App. A.3].

N generator processes decode while the trainer trains, each a VLLMEngine (scalerl.py) on a device of its own: on CUDA
generator i takes GPU LOCAL_WORLD_SIZE + i, on a CPU each process an equal share of the cores. The trainer hands them
requests through a queue and its weights through one safetensors file in shared memory, and reads their finished
completions back as Reports. SplitEngine keeps scalerl.py's engine contract (submit, step, push, abort, close, sleep,
version, capacity, preemptions; see its section 5), so the recipe's loop runs unchanged on it: PipelineRL-k's lag
bound holds as in one process (docs/off-policy.md). scalerl.py's make_engine imports this file only for --generators.
This file imports nothing of scalerl.py: make_engine hands SplitEngine the engine class each generator runs, the
weights a push writes, and the error class the run reports a failed generator with.
"""
import contextlib
import dataclasses
import os
import queue
import shutil
import signal
import tempfile
import time
import traceback
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist


def rank_world():
    """(this trainer's rank, the trainer's ranks): under torchrun its process group's, in one process (0, 1)."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def weights_dir(model, dtype, fp32_head, shm="/dev/shm"):
    """The split's weights file goes to shared memory if it has room for two (a generator may still read the last
    while the next is written; Docker gives /dev/shm 64 MB), else to a temporary directory on disk."""
    n, head = sum(p.numel() for p in model.parameters()), model.get_output_embeddings().weight.numel()
    size, free = n * dtype.itemsize + 4 * head * fp32_head, shutil.disk_usage(shm).free if os.path.isdir(shm) else 0
    if os.path.isdir(shm) and free < 2 * size:
        print(f"scalerl: {shm} has {free / 2**20:.0f} MB free, less than two weights files ({2 * size / 2**20:.0f} "
              f"MB): they go through {tempfile.gettempdir()} instead")
    return tempfile.mkdtemp(prefix="scalerl-", dir=shm if free >= 2 * size else None)


def write_weights(path, weights, version):
    """The (name, tensor) pairs of `weights` (the float32 LM head among them as 'fp32_head') as one safetensors file,
    renamed into place: a generator still reading the previous file keeps it. Under torchrun every rank iterates (each
    tensor is gathered), rank 0 writes."""
    from safetensors.torch import save_file
    r, w = rank_world()
    tensors = {n: t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format) for n, t in weights if r == 0}
    if r == 0:
        save_file(tensors, path + ".tmp", metadata={"version": str(version)})
        os.replace(path + ".tmp", path)
    if w > 1:
        dist.barrier()  # no rank sends a request for this version before its weights are in place


# The messages, one record each. Trainer -> generator i, on its own queue: an Order ("submit" with its Requests,
# "abort", "stop"). Generator -> trainer, on the shared queue: Ready once its engine is up, a Report after each engine
# step that finished pieces, Failed with its traceback.
class Request(NamedTuple):
    key: tuple
    ids: list
    max_tokens: int
    seed: int
    version: int  # the trainer's weights when it was submitted: the generator loads them first if it has older ones


class Order(NamedTuple):
    kind: str  # "submit", "abort" or "stop"
    requests: list = ()


class Ready(NamedTuple):
    generator: int
    capacity: int  # the sequences its engine decodes at once


class Report(NamedTuple):
    generator: int
    pieces: list     # (key, Completion) of the requests it finished
    decoded: int     # tokens decoded and engine steps taken since its last report
    steps: int
    taken: int       # requests taken so far, sequences left, capacity and preemptions, now
    left: int
    capacity: int
    preemptions: int


class Failed(NamedTuple):
    generator: int
    traceback: str


def generator_main(i, engine_class, place, cfg, path, device, dtype, max_model_len, weights, requests, results, cores,
                   parent):
    """Generator i: an engine_class (VLLMEngine) decoding whenever it has requests, the newest weights file loaded
    between two engine steps (and before a request that asks for newer weights); it stops when told to, or when the
    trainer is gone."""
    from safetensors import safe_open
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the trainer stops us
    loaded, steps, decoded, taken = None, 0, 0, 0

    def refresh():
        nonlocal loaded
        st = os.stat(weights)
        if (st.st_ino, st.st_mtime_ns) != loaded:
            loaded = st.st_ino, st.st_mtime_ns
            with safe_open(weights, "pt") as f:
                engine.load(((n, f.get_tensor(n)) for n in f.keys() if n != "fp32_head"),
                            (lambda: f.get_tensor("fp32_head")) if cfg.lm_head_fp32 else None,
                            int(f.metadata()["version"]))
    try:
        if cores:
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
        engine = engine_class(cfg, path, torch.device(device), dtype, max_model_len, place)
        results.put(Ready(i, engine.capacity))
        while os.getppid() == parent:
            refresh()
            orders = []
            with contextlib.suppress(queue.Empty):
                orders.append(requests.get(block=not engine.unfinished(), timeout=0.05))  # (block with nothing to do)
                while True:
                    orders.append(requests.get_nowait())
            for order in orders:
                if order.kind == "stop":
                    return
                if order.kind == "abort":
                    engine.abort()
                if order.kind == "submit":  # what the trainer submitted between two of its engine calls, in one order
                    if order.requests[-1].version > engine.version:  # pushed before they were sent: the file has it
                        refresh()
                    for r in order.requests:
                        engine.submit(r.key, r.ids, r.max_tokens, r.seed)
                    taken += len(order.requests)
            if engine.unfinished():
                done, n, k = engine.step()
                steps, decoded = steps + k, decoded + n
                if done:  # with how many requests it has taken so far, and what it has left
                    results.put(Report(i, done, decoded, steps, taken, engine.unfinished(), engine.capacity,
                                       engine.preemptions))
                    steps, decoded = 0, 0
    except Exception:  # noqa: BLE001  (whatever it is, the trainer reports it and stops)
        results.put(Failed(i, traceback.format_exc()))
    finally:
        if os.getppid() != parent:  # the trainer is gone: nobody reads, nobody cleans up
            results.cancel_join_thread()
            shutil.rmtree(os.path.dirname(weights), ignore_errors=True)
        results.close()
        results.join_thread()  # (what it sent is in the pipe)
        # the interpreter's own exit, after a vLLM engine, waited in native code (seconds, until the trainer killed it)
        os._exit(0)


@dataclass
class Generator:
    """What the trainer knows of one generator process: `queue`, what was submitted since the last engine call; taken,
    left, capacity and preemptions as it last reported; `sent`, the requests sent it so far; idle_since (None: busy)."""
    proc: object
    requests: object
    queue: list = field(default_factory=list)
    taken: int = 0
    left: int = 0
    capacity: int = 0
    preemptions: int = 0
    sent: int = 0
    idle_since: float = None

    def queued(self):
        """Its sequences queued or decoding: what it had left when it last reported, plus what it took since."""
        return self.left + self.sent - self.taken


class SplitEngine:
    """Engine 'vllm' with --generators N: the VLLMEngine contract, served by generator processes (rank r owns r, r + W,
    ...): step() and sleep() send what was submitted, step() returns what they finished, waiting only when nothing has.
    On CUDA generator i takes GPU LOCAL_WORLD_SIZE + i, on CPU each process a share of the cores. From the trainer:
    engine_class, what each generator runs (VLLMEngine); weights(model), the (name, tensor) pairs a push writes; error,
    the exception a failed generator stops the run with (status 1, resumable: the run's last step is checkpointed)."""

    def __init__(self, cfg, path, device, dtype, max_model_len, model, engine_class, weights, error):
        self.cfg, self.version, self.live, self.gens = cfg, 0, {}, {}
        self.weights_of, self.error, (r, w) = weights, error, rank_world()
        self.rank = r  # (close() removes the weights file on rank 0, after any process group is gone)
        box = [weights_dir(model, dtype, cfg.lm_head_fp32) if r == 0 else None]
        if w > 1:
            dist.broadcast_object_list(box, src=0)
        self.dir = box[0]
        self.weights = os.path.join(self.dir, "weights.safetensors")
        write_weights(self.weights, weights(model), 0)
        ctx = torch.multiprocessing.get_context("spawn")
        self.results, self.idle = ctx.Queue(), [0.0, time.time()]  # (take_idle)
        self.restore, local, cores, share = self.share_cores(device)
        gen_cfg = dataclasses.replace(cfg, vllm_sleep=False, vllm_gpu_memory_utilization=0.9)
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(local + cfg.generators)))).split(",")
        try:
            for i in range(r, cfg.generators, w):
                requests = ctx.Queue()
                proc = ctx.Process(target=generator_main, daemon=True, args=(
                    i, engine_class, w + i, gen_cfg, path, device.type, dtype, max_model_len, self.weights, requests,
                    self.results, cores[(local + i) * share:(local + i + 1) * share], os.getpid()))
                self.gens[i] = Generator(proc, requests, idle_since=time.time())
                env = {"OMP_NUM_THREADS": str(share)} if cores else {"CUDA_VISIBLE_DEVICES": gpus[local + i]}
                with environment(env, drop=("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")):  # a plain engine
                    proc.start()
            for _ in self.gens:
                ready = self.receive()
                self.gens[ready.generator].capacity = ready.capacity
        except BaseException:
            self.close()
            raise

    def share_cores(self, device):
        """On a CPU each process of this node an equal share of the cores, trainer ranks first: this one's taken now."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        cores = sorted(os.sched_getaffinity(0)) if device.type == "cpu" else []
        restore, share = (cores, torch.get_num_threads()), max(1, len(cores) // (local + self.cfg.generators))
        if cores:
            r = int(os.environ.get("LOCAL_RANK", 0))
            os.sched_setaffinity(0, cores[r * share:(r + 1) * share])
            torch.set_num_threads(share)
        return restore, local, cores, share

    def receive(self):
        """The next message from a generator. One that failed or died stops the run (status 1, resumable: the Recorder
        saves a checkpoint of the last step), so does silence for --generator-timeout seconds."""
        patience = self.cfg.generator_timeout or max(900.0, 0.5 * self.cfg.max_new_tokens)
        deadline = time.time() + patience
        while True:  # (what a generator sent before it ended, its error, is read first)
            with contextlib.suppress(queue.Empty):
                return self.checked(self.results.get(timeout=1.0))
            for i, g in self.gens.items():
                if not g.proc.is_alive():
                    raise self.error(f"generator {i} (pid {g.proc.pid}) died, exit code {g.proc.exitcode}", 1, True)
            if time.time() > deadline:
                raise self.error(f"no word from the generators in {patience:g} s (--generator-timeout)", 1, True)

    def checked(self, msg):
        if isinstance(msg, Failed):
            raise self.error(f"generator {msg.generator} failed: {msg.traceback.strip().splitlines()[-1]}", 1, True)
        return msg

    def submit(self, key, ids, max_tokens, seed):
        # a group's completions go to one generator (one request there), the same in every run (not hash(): salted)
        i = sorted(self.gens)[zlib.crc32(repr(key[0]).encode()) % len(self.gens)]
        self.gens[i].queue.append(Request(key, list(ids), max_tokens, seed, self.version))
        self.gens[i].sent += 1
        self.live[key] = i

    def flush(self):
        """Send each generator what was submitted since the last engine call, in one message: its engine adds them all
        before its next step, as a VLLMEngine in this process does (the same batches, the same float rounding)."""
        for g in self.gens.values():
            if g.queue:
                g.requests.put(Order("submit", g.queue))
                self.idle[0] += time.time() - (g.idle_since or time.time())
                g.queue, g.idle_since = [], None

    def unfinished(self):
        return sum(g.queued() for g in self.gens.values())

    def step(self):
        self.flush()
        reports = [self.receive()]
        with contextlib.suppress(queue.Empty):
            while True:
                reports.append(self.checked(self.results.get_nowait()))
        done = [(key, c) for r in reports for key, c in r.pieces if self.live.pop(key, None) is not None]
        for r in reports:
            g = self.gens[r.generator]
            g.taken, g.left, g.capacity, g.preemptions = r.taken, r.left, r.capacity, r.preemptions
            if not g.queued() and g.idle_since is None:  # nothing to do until the next submit: idle from now
                g.idle_since = time.time()
        return done, sum(r.decoded for r in reports), sum(r.steps for r in reports)

    @property
    def preemptions(self):
        return sum(g.preemptions for g in self.gens.values())

    @property
    def capacity(self):
        """Twice what the generators decode at once, as each last said: work to go on with while the trainer trains."""
        return 2 * self.decoding()

    def decoding(self):
        return sum(g.capacity for g in self.gens.values())

    def take_idle(self):
        """(Seconds this rank's generators had nothing to decode, seconds elapsed), since the last call."""
        now, (idle, since) = time.time(), self.idle
        idle += sum(now - g.idle_since for g in self.gens.values() if g.idle_since is not None)
        self.idle = [0.0, now]
        for g in self.gens.values():
            g.idle_since = None if g.idle_since is None else now
        return idle, now - since

    def push(self, model, version):
        write_weights(self.weights, self.weights_of(model), version)
        self.version = version

    def abort(self):
        for g in self.gens.values():
            g.requests.put(Order("abort"))
            g.queue = []
        self.live = {}

    def close(self):
        """Stop the generators (5 s to go, then killed), remove the weights file, give this process its cores back."""
        for g in self.gens.values():
            g.requests.put(Order("stop"))
        for g in self.gens.values():
            g.proc.join(timeout=5)
            if g.proc.is_alive():
                g.proc.kill()
                g.proc.join(timeout=5)
            g.requests.cancel_join_thread()  # (what a dead generator left unread is dropped)
            g.requests.close()
        if self.rank == 0:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.results.close()
        self.gens = {}
        if self.restore[0]:
            os.sched_setaffinity(0, self.restore[0])
            torch.set_num_threads(self.restore[1])

    def sleep(self):
        """The trainer trains now: the generators (which never sleep) get what was submitted, to decode meanwhile."""
        self.flush()


@contextlib.contextmanager
def environment(values, drop=()):
    """os.environ with `values` set and `drop` removed inside the block (a child process started there takes it)."""
    saved = dict(os.environ)
    for k in drop:
        os.environ.pop(k, None)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
