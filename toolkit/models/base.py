"""The model adapter contract: everything family-specific lives behind it.

The trainer never asks which family it is training. It drives every adapter through the same sequence:

    adapter = AdapterClass(settings, runtime)
    adapter.memory.base_parameters()    # the frozen model's size, counted without loading (device.distributed)
    adapter.load(shard_base)            # base weights, frozen, with the LoRA added; its memory plan decided
    dataset = adapter.prepare_data()    # data and caches; then the trainable modules onto the device
    modules = {name: wrap(m) for name, m in adapter.trainable_modules().items()}   # DDP when several processes
    each step: adapter.begin_step(step); adapter.batch_units(batch); adapter.loss(batch, modules)

and reads back `sample`, `eval_loss`, `save_lora` and `load_lora` around the steps. Everything the trainer plans
about memory (the model's size, its quantization, its repeated blocks to compile, checkpoint and swap, what fsdp
shards, how to turn checkpointing on, what to suggest when memory runs out) is one object, `adapter.memory`
(ModelMemory), of the same shape for every family.

`loss` must call the modules it is given (the trainer's wrappers), never its own references to them: DDP
averages gradients only for a forward through its wrapper.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import torch
from omegaconf import DictConfig

from toolkit.config.families import FamilySpec, family_spec
from toolkit.device.detect import DeviceInfo
from toolkit.plan.decisions import Decision


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Runtime:
    """Where and how the adapter runs: device, dtypes, run folder, and how it logs and shares work with
    other processes (the trainer fills these in; the defaults describe a single process)."""

    device: torch.device
    info: DeviceInfo
    base_dtype: torch.dtype        # frozen base weights
    compute_dtype: torch.dtype     # autocast dtype (fp32 means no autocast)
    run_dir: Path
    log: Callable[[str], None] = _stderr          # the run's log; silent on every process but the main one
    is_main: bool = True
    world_size: int = 1
    rank: int = 0
    main_process_first: Callable[[], AbstractContextManager] = field(default=nullcontext)
    """Context for work that writes shared files (caches): the main process runs it first, then the others."""
    settled: Callable[[str], Any] = field(default=lambda key: None)
    """The value the run's plan has settled for a dotted key so far (the static stage, then the loaded stage as it
    grows); None where no plan is at hand (an adapter built outside a run). For the choices an adapter makes while
    loading, such as GRPO's generation path."""


class TrainDataset(Protocol):
    """Items addressed by index; `groups` puts each item in a bucket so a batch never mixes shapes."""

    groups: Sequence[int]

    def __len__(self) -> int: ...

    def epoch_entries(self, epoch: int) -> Sequence[int]:
        """What `epoch` trains: entry e is item e % len(self) (data/datasets.py: repeats, weighted datasets)."""

    def collate(self, indices: Sequence[int], epoch: int = 0) -> dict[str, Any]:
        """A batch (CPU tensors) of the entries at `indices`, drawn in `epoch` (which seeds any augmentation)."""

    def largest_batch(self, size: int) -> list[int]:
        """Indices of a batch of `size` items that takes as much memory as any batch of that size can (items may
        repeat): what train.batch_size=auto measures (train/batch_size.py)."""


class ModelMemory:
    """What the trainer plans about a model's memory, the same for every family. The defaults describe a model
    with nothing to plan; each kind of model (llm.py, diffusion_base.py, flow_memory.py) says what it has."""

    unused_parameters = False
    """Whether some LoRA weights get no gradient in a step (DDP must then look for them)."""

    def base_parameters(self) -> int | None:
        """Parameters of the frozen model(s) that train, counted without loading weights (None: unknown);
        device.distributed=auto decides from it."""
        return None

    def decisions(self) -> dict[str, Decision]:
        """What loading decided of the settings the model plans itself (model.quantize, model.expert_offload,
        model.block_swap), by setting: the loaded stage of the run's plan."""
        return {}

    def attention_without_sdpa(self) -> str | None:
        """Why the loaded model's attention never calls scaled_dot_product_attention (device.sdpa_backend, which
        the memory plan measures, then has nothing to choose), or None when it does."""
        return None

    def quantized(self) -> str:
        """How the frozen denoiser is quantized for training (none, 8bit, 4bit, fp8), once loaded."""
        return "none"

    def regions(self, checkpointed: bool) -> dict[str, list[torch.nn.Module]]:
        """By trainable module, its repeated blocks in forward order, which train/blocks.py compiles, checkpoints
        and swaps one by one (`checkpointed`: whether any of them will be checkpointed, which may change what a
        block is). Empty: the trainer compiles shard_roots' repeated blocks whole and the model checkpoints its
        own way (llm, through transformers)."""
        return {}

    def swaps(self) -> dict:
        """By trainable module, its BlockSwap (models/block_swap.py) when model.block_swap moves blocks."""
        return {}

    def shard_roots(self) -> dict[str, torch.nn.Module]:
        """For device.distributed=fsdp, by trainable module: the model whose forward the family calls (its
        blocks and then itself are sharded)."""
        return {}

    def enable_checkpointing(self) -> None:
        """Turn gradient checkpointing on after loading (train.gradient_checkpointing=auto measured that a step
        needs it). Denoisers need nothing here: train/blocks.py checkpoints their blocks when it wraps them."""

    def fixes(self) -> list[str]:
        """Out-of-memory remedies specific to the model (the trainer adds the generic ones)."""
        return []

    def sequence_variants(self) -> int:
        """How many token counts one batch shape may take in the forward (compiled blocks see each as another
        shape): 1 unless the family cuts each batch's text to its own tokens (hunyuan_video15)."""
        return 1


class ModelAdapter(ABC):
    """One model family: loading, data, loss, sampling and LoRA files (see the module docstring). Subclasses are
    a kind (DiffusionAdapter) and its families, or a family of its own (LLMAdapter): two levels at most."""

    network: torch.nn.Module | None
    """The root module of every LoRA weight; its parameter names are the names in checkpoints."""
    memory: ModelMemory

    def __init__(self, cfg: DictConfig, runtime: Runtime):
        self.cfg = cfg             # the run's settings (read-only)
        self.runtime = runtime
        self.spec: FamilySpec = family_spec(cfg.model.family)
        self.network = None
        self.shard_base = False    # set by load(): device.distributed=fsdp with several processes

    @property
    def family(self) -> str:
        return self.spec.name

    def log(self, message: str) -> None:
        self.runtime.log(message)

    # -- required ----------------------------------------------------------------------------
    @abstractmethod
    def load(self, shard_base: bool = False) -> None:
        """Load the base model from cfg.model.name_or_path, freeze it and add the LoRA. `shard_base`
        (device.distributed=fsdp with several processes): the frozen base stays in CPU memory, and the trainer
        shards it onto the devices (each process holds 1/N of it) and moves the LoRA weights there."""

    @abstractmethod
    def prepare_data(self) -> TrainDataset:
        """The training data (cfg.data) with its caches filled; then the trainable modules and what their forward
        needs go onto the device."""

    @abstractmethod
    def trainable_modules(self) -> dict[str, torch.nn.Module]:
        """The modules that carry LoRA weights, each run by its own forward: what the trainer wraps."""

    @abstractmethod
    def batch_units(self, batch: dict[str, Any]) -> tuple[int, int]:
        """(units, tokens) of `batch`, counted before the forward: how many units (tokens, samples) its loss sums
        over, and its tokens for the tokens/s metric (0: the family does not count tokens)."""

    @abstractmethod
    def loss(self, batch: dict[str, Any], modules: Mapping[str, torch.nn.Module]) -> torch.Tensor:
        """The SUM of the batch's per-unit losses, computed through `modules` (the trainer divides by the
        step's total units over micro-batches and processes, so every unit counts the same)."""

    @abstractmethod
    def sample(self, out_dir: Path) -> list[Path]:
        """Generate from cfg.sample.prompts into out_dir; return the files written."""

    @abstractmethod
    def save_lora(self, out_dir: Path, dtype: torch.dtype) -> list[Path]:
        """Export the LoRA in the ecosystem's format (cfg.save.format) into out_dir."""

    @abstractmethod
    def load_lora(self, path: Path, partial: bool = False, label: str | None = None) -> None:
        """Load a LoRA (a file or folder the family's loader reads; a run folder means its final/) into the trained
        LoRA; `partial`: modules it does not cover keep their weights (network.init_from); `label`: how messages
        name it (else its path)."""

    # -- optional (defaults) ---------------------------------------------------------------------
    def prepare_sampling(self) -> None:
        """Without training (the `sample` command: load(), load_lora(), then this): what sample() needs that
        prepare_data() would have done."""

    @classmethod
    def training_prompts(cls, cfg: DictConfig, count: int) -> tuple[list[str], str]:
        """For `sample` with no --prompt and no sample.prompts: up to `count` prompts of the run's training data and
        where they came from (never empty), read without loading the model; a UserError says why the data gives none."""
        from toolkit.errors import UserError

        raise UserError(f"model.family={cfg.model.family} takes no sample prompts from its training data")

    def begin_step(self, step: int) -> None:
        """Called before optimizer step `step` (1-based), for state that follows the step number."""

    def eval_interval(self) -> int:
        """Steps between eval losses (0: only at the end): train.eval_every (the diffusion families: eval.every)."""
        return int(self.cfg.train.eval_every)

    def eval_loss(self, batch_size: int) -> float | None:
        """Mean loss on held-out data in batches of `batch_size`, or None when the family/config has none."""
        return None

    def quantize_setting(self) -> str:
        """model.quantize as this run applies it: auto means none when the base is sharded (sharding is then
        the memory plan); 4bit/8bit with fsdp are refused before anything loads."""
        if self.shard_base and self.cfg.model.quantize == "auto":
            self.log("model.quantize=auto -> none: device.distributed=fsdp shards the frozen base instead")
            return "none"
        return self.cfg.model.quantize


def lora_targets(network: torch.nn.Module) -> list[str]:
    """The names of the modules that carry adapter weights (PEFT's LoRA, LoKr or LoHa layers)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return sorted(n for n, m in network.named_modules() if isinstance(m, BaseTunerLayer))


@contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """`module` in eval mode for the block (dropout off), then back in the mode it was in."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def repeated_blocks(root: torch.nn.Module, outermost: bool = False) -> list[torch.nn.Module]:
    """The model's `_no_split_modules` blocks, in module order (with `outermost`, not those inside another).
    A block's class counts by any name in its MRO: FSDP2's fully_shard renames a LlamaDecoderLayer's class to
    FSDPLlamaDecoderLayer (a subclass)."""
    block_types = set(getattr(root, "_no_split_modules", None) or [])
    blocks = [m for m in root.modules() if any(c.__name__ in block_types for c in type(m).__mro__)]
    if not outermost:
        return blocks
    inner = {id(m) for block in blocks for m in block.modules() if m is not block}
    return [b for b in blocks if id(b) not in inner]


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether `module` is an FSDP2 unit (device.distributed=fsdp)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a PyTorch build without torch.distributed
        return False
    return isinstance(module, FSDPModule)


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def trainable_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of every trainable tensor, by parameter name."""
    return {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}


def load_trainable_state_dict(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy saved trainable tensors back; names must match exactly."""
    params = {name: p for name, p in module.named_parameters() if p.requires_grad}
    missing, unexpected = set(params) - set(state), set(state) - set(params)
    if missing or unexpected:
        raise ValueError(f"LoRA weights do not match the model: {len(missing)} missing "
                         f"(e.g. {sorted(missing)[:2]}), {len(unexpected)} unexpected (e.g. {sorted(unexpected)[:2]})")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name].to(p.device, p.dtype))


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
