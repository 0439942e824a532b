"""Several training processes, on torch.distributed as accelerate sets it up (NCCL on CUDA, RCCL through the
`nccl` name on ROCm, gloo on the CPU). This file only says which collectives the trainer uses and how it
wraps the trainable modules; every byte goes through torch.distributed.

Two ways to share the work (device.distributed):
- ddp: every process holds the whole model; each trainable module is wrapped in DistributedDataParallel.
- fsdp: the frozen base is sharded with FSDP2 (`fully_shard`, block by block, the input embeddings and the
  output head each on their own where untied, then the model), so each process holds 1/N of it and gathers a
  unit's weights just before using it. The LoRA weights are left out
  of the sharding (`ignored_params`): they are small, stay whole on every process, and their gradients are
  averaged with one all-reduce per step (`average_gradients`), so the optimizer, EMA, checkpoints and
  exports see ordinary tensors, exactly as with one process. The optimizer's state is what gets sharded
  (device.shard_optimizer: train/optimizer_shards.py).

Why DistributedDataParallel directly rather than accelerator.prepare_model: prepare_model also patches the
module's forward for mixed precision and may move the whole module to the device. The trainer already
autocasts, and a Wan 2.2 expert may keep its frozen weights in CPU memory on purpose. The frozen base
weights and buffers are left out of DDP (nothing to average, and no start-up broadcast of billions of
parameters): every rank loaded the same files, and only LoRA weights train.
"""

from __future__ import annotations

import os
import re
import sys
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from toolkit.errors import UserError

TIMED_OUT = re.compile(r"timed? ?out|timeout", re.IGNORECASE)
PEER_LOST = re.compile(r"connection (reset|closed|refused)|broken pipe|closed by peer|peer .*(closed|hung up)",
                       re.IGNORECASE)


def collective_failure(err: BaseException, rank: int, world_size: int, what: str) -> UserError | None:
    """What a collective's error means for the user, naming this process's rank and what it was doing: the others
    did not come within device.collective_timeout, or one of them is gone. None: another error (raised as it is)."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    if TIMED_OUT.search(str(err)):
        return UserError(
            f"rank {rank} of {world_size}: timed out in the {what}: the other processes did not join it within "
            f"device.collective_timeout ({first})\n  fix: the process that stopped answering says why in its output "
            "(a deadlock, a GPU fault, a slow disk under the main process); raise device.collective_timeout if a step, "
            "a checkpoint or a cache fill can take that long; with --max-restarts N every process restarts from the "
            "last checkpoint instead")
    if PEER_LOST.search(str(err)):
        return UserError(
            f"rank {rank} of {world_size}: lost the other processes in the {what}: one of them stopped ({first})"
            "\n  fix: its output, or the launcher's line, says which and why; run the same command to resume from the "
            "last checkpoint (with --max-restarts N the launcher does it)")
    return None


def _caller() -> str:
    """Who called the Processes method that calls this: the trainer's step, a checkpoint, a decision..."""
    code = sys._getframe(2).f_code
    return getattr(code, "co_qualname", code.co_name)


class Processes:
    """The processes of one run, from the accelerator: who is main, and the collectives the trainer uses."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.world_size = accelerator.num_processes
        self.rank = accelerator.process_index
        self.is_main = accelerator.is_main_process
        self.device = accelerator.device

    @property
    def several(self) -> bool:
        return self.world_size > 1

    @contextmanager
    def _collective(self, operation: str, caller: str) -> Iterator[None]:
        """A timed-out or broken collective as a UserError naming this rank and `operation` (called from `caller`)."""
        try:
            yield
        except RuntimeError as err:  # gloo's errors and DistBackendError (NCCL) are RuntimeErrors
            failure = collective_failure(err, self.rank, self.world_size, f"{operation} called from {caller}")
            if failure is None:
                raise
            raise failure from None

    def wrap(self, modules: Mapping[str, torch.nn.Module], find_unused: bool) -> dict[str, torch.nn.Module]:
        """Each trainable module in its own DDP wrapper (one process: the modules themselves)."""
        if not self.several:
            return dict(modules)
        from torch.nn.parallel import DistributedDataParallel

        wrapped = {}
        for name, module in modules.items():
            frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
            frozen += [n for n, _ in module.named_buffers()]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, frozen)
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped[name] = DistributedDataParallel(module, device_ids=device_ids, find_unused_parameters=find_unused)
        return wrapped

    def shard(self, roots: Mapping[str, torch.nn.Module], timeout: timedelta,
              lookup_in_shards: bool = True) -> list[str]:
        """FSDP2 on each root: its repeated blocks (the model's `_no_split_modules` classes), its input embeddings
        and output head where they have weights of their own (`edge_modules`), then the root; the trainable (LoRA)
        weights are not sharded and are moved to this process's device. Each root is marked as FSDP-managed, so that
        transformers' generate keeps the processes in step (synced_gpus: one that finished early still runs the
        forwards the others' gathers need). `timeout`: device.collective_timeout, for the host-side group of the
        sharded embeddings; `lookup_in_shards`: device.fsdp_embeddings=shards. Returns what was sharded, per root."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from toolkit.kernels.sharded_embedding import ShardedEmbedding, shardable

        from toolkit.models.base import repeated_blocks

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        done = []
        for name, root in roots.items():
            blocks = repeated_blocks(root)
            if not blocks:
                raise UserError(f"device.distributed=fsdp: the {name} ({type(root).__name__}) names no repeated "
                                "blocks to shard\n  fix: device.distributed=ddp")
            edges = edge_modules(root)
            kinds = ", ".join(sorted({type(b).__name__ for b in blocks}))  # before fully_shard renames the classes
            lookup = lookup_in_shards and bool(edges) and shardable(edges[0])
            # inner blocks first: an outer one then takes what is left; the root takes what no unit holds
            for unit in [*reversed(blocks), *edges, root]:
                fully_shard(unit, mesh=mesh, ignored_params={p for p in unit.parameters() if p.requires_grad})
            root._is_fsdp_managed_module = True  # transformers' is_fsdp_managed_module: generate(synced_gpus=True)
            if lookup:  # looked up in the shards (kernels/sharded_embedding.py), never gathered whole
                counts = dist.new_group(backend="gloo", timeout=timeout) if self.device.type != "cpu" else None
                root.set_input_embeddings(ShardedEmbedding(edges[0], counts))
                lookup = isinstance(root.get_input_embeddings(), ShardedEmbedding)  # a model's own setter may not
            for p in root.parameters():
                if p.requires_grad:
                    p.data = p.data.to(self.device)
            edge_note = (" + input embeddings and output head, each its own unit" if edges else "") + (
                " (the embeddings looked up in the processes' shards, never gathered whole)" if lookup else "")
            done.append(f"{name}: {len(blocks)} blocks ({kinds}){edge_note}")
        return done

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """The mean over processes of the gradients of `params` (fsdp's unsharded LoRA weights, or every LoRA weight
        with device.gradient_sync=allreduce), in one all-reduce of a flat buffer: one kernel gathers them into it
        and one multi-tensor copy puts them back (a copy per tensor would launch one kernel for each of the
        hundreds of LoRA tensors, every step). Which parameters have a gradient is the same on every process (the
        same graph runs everywhere: the same Wan 2.2 expert, the same unused layers)."""
        grads = [p.grad for p in params if p.grad is not None]
        if not self.several or not grads:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        with self._collective("gradient all-reduce", _caller()):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= self.world_size
        parts = [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads)]
        torch._foreach_copy_(grads, parts)

    @contextmanager
    def no_sync(self, modules: Mapping[str, torch.nn.Module], skip: bool) -> Iterator[None]:
        """Gradient all-reduce held back for every wrapped module (an accumulation micro-batch) when `skip`."""
        with ExitStack() as stack:
            if skip and self.several:
                for module in modules.values():
                    stack.enter_context(module.no_sync())
            yield

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """The element-wise sum over processes (in place)."""
        if self.several:
            with self._collective("all-reduce (sum)", _caller()):
                dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values

    def from_main(self, value: Any) -> Any:
        """The main process's `value`, on every process."""
        if not self.several:
            return value
        box = [value if self.is_main else None]
        with self._collective("broadcast from the main process", _caller()):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def check_same_weights(self, network: torch.nn.Module, log) -> None:
        """With several processes, every one must hold the same LoRA weights at the end: compared by checksum,
        so a broken gradient all-reduce can never pass silently."""
        if not self.several:
            return
        import hashlib

        digest = hashlib.sha256()
        for name, p in sorted(network.named_parameters()):
            if p.requires_grad:
                digest.update(name.encode())
                digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        digests = self.gather(digest.hexdigest())
        if len(set(digests)) != 1:
            raise RuntimeError(f"the processes ended with different LoRA weights (sha256 by rank: {digests}); "
                               "this is a bug in the toolkit, please report it")
        log(f"processes: LoRA weights identical on all {self.world_size} (sha256 {digests[0][:16]})")

    def gather(self, value: Any) -> list[Any]:
        """Every process's `value`, by rank, on every process."""
        if not self.several:
            return [value]
        out: list[Any] = [None] * self.world_size
        with self._collective("all-gather", _caller()):
            dist.all_gather_object(out, value)
        return out

    def main_first(self):
        """Context: the main process runs the block first (filling shared caches), then the others."""
        return self.accelerator.main_process_first()

    def barrier(self) -> None:
        if self.several:
            with self._collective("barrier", _caller()):
                self.accelerator.wait_for_everyone()

    def finish(self) -> None:
        """At the end of a run that went well: wait until the main process has written the final files, then
        close the process group. A process leaving with the group open can abort in its shutdown
        ("terminate called without an active exception") and fail the launch."""
        if self.several and dist.is_initialized():
            self.barrier()
            dist.destroy_process_group()


def join_restarted_group(backend: str, timeout: timedelta) -> bool:
    """On a launcher's restart (--max-restarts): open this process's group on the launcher's store under a prefix of
    its own attempt, before accelerate would open it on the bare store. The store outlives the attempts, and gloo
    finds the dead attempt's keys there (its peers' old addresses): the restarted processes then never meet.
    `backend`: the device's ("cpu" -> gloo, else nccl, RCCL on ROCm). Returns whether it opened the group."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if not restart or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return False
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    dist.init_process_group("gloo" if backend == "cpu" else "nccl", store=dist.PrefixStore(f"toolkit/attempt-{restart}",
                            store), rank=rank, world_size=world_size, timeout=timeout)
    return True


def edge_modules(root: torch.nn.Module) -> list[torch.nn.Module]:
    """A transformers model's input embeddings and output head, to be sharded as units of their own: left in the
    root's unit, FSDP2 keeps them gathered from the first forward to the end of backward (it does not reshard the
    root after forward), which for a large vocabulary is gigabytes per process. Tied weights (one parameter in
    both) stay in the root: a parameter belongs to one unit."""
    get_input, get_output = getattr(root, "get_input_embeddings", None), getattr(root, "get_output_embeddings", None)
    if get_input is None or get_output is None:
        return []
    parts = [get_input(), get_output()]
    if not all(isinstance(part, torch.nn.Module) and isinstance(getattr(part, "weight", None), torch.Tensor)
               for part in parts):
        return []
    if parts[0].weight is parts[1].weight:
        return []
    return parts
