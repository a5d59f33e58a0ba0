"""The recipe schema. Fields left unset (None) are filled by `toolkit.recipe.resolve`, which records
where each value came from; `ft recipe explain` shows it."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from toolkit.base.names import ENV_NAME_PATTERN, NAME_PATTERN
from toolkit.storage.object_store import is_s3_url, parse_s3_url

REVISION_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}(/[A-Za-z0-9_][A-Za-z0-9._-]{0,99}){0,4}"
# Environment names that carry secrets (a word of the name, so TOKENIZERS_PARALLELISM is not one):
# passed from the submitting environment by name, never written into a script.
SECRET_ENV_WORDS = {"KEY", "APIKEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASS", "CREDENTIAL", "CREDENTIALS"}
# Values that are secrets whatever their name: tokens of well-known services, passwords in URLs.
SECRET_VALUES = re.compile(r"\bhf_[A-Za-z0-9]{20,}|\b(AKIA|ASIA)[A-Z0-9]{16}\b|\bgh[pousr]_[A-Za-z0-9]{30,}|"
                           r"\bsk-[A-Za-z0-9_-]{20,}|://[^/\s:@]+:[^/\s@]+@")
# Names the job script, Slurm, the launcher or the shell set or rely on: a recipe may not change them.
RESERVED_ENV = re.compile(r"(SLURM|SLURMD|PMI|PMIX|OMPI|TORCHELASTIC)_.*|FT_(?!FAULT_).*|"
                          r"RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|NODE_RANK|MASTER_ADDR|MASTER_PORT|"
                          r"CUDA_VISIBLE_DEVICES|SHELLOPTS|BASHOPTS|BASH_ENV|ENV|IFS|PS4|PATH|HOME|PWD|OLDPWD|"
                          r"CDPATH|GLOBIGNORE|LD_PRELOAD|LD_LIBRARY_PATH|PYTHONPATH|PYTHONHOME|PYTHONSTARTUP")
MAX_ENV_VALUE_BYTES = 128 * 1024 - 1  # Linux refuses a longer single string when the job starts


def _holds(kind: type, annotation: object) -> bool:
    """Whether a field's type admits `kind` (itself, or a union or Annotated holding it)."""
    return annotation is kind or any(_holds(kind, arg) for arg in get_args(annotation))


class Strict(BaseModel):
    # inf and nan are no numbers a recipe means (`epochs: .inf` would train forever).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_enum_values=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def numbers_are_not_booleans(cls, value: object, info: ValidationInfo) -> object:
        """`nodes: true` is a mistake, not 1 (pydantic takes true for 1 and 1.0)."""
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and not _holds(bool, annotation):
            raise ValueError(f"expected {_kind(annotation)}, not {str(value).lower()}")
        return value


def _kind(annotation: object) -> str:
    """What a field holds, in words, for an error: 'a whole number', 'a number', ..."""
    if _holds(int, annotation):
        return "a whole number"
    return "a number" if _holds(float, annotation) else "a value of this field's kind"


class Method(StrEnum):
    lora = "lora"
    qlora = "qlora"
    full = "full"


class Objective(StrEnum):
    sft = "sft"
    dpo = "dpo"


class DataFormat(StrEnum):
    auto = "auto"
    prompt_completion = "prompt_completion"
    chat = "chat"
    preference = "preference"


class Precision(StrEnum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class Tier(StrEnum):
    free = "free"
    standard = "standard"
    premium = "premium"


class ModelSpec(Strict):
    base: str = Field(description="Local path, a model id (resolved through the cluster's model cache), "
                                  "or 'tiny-llama' (built locally: tests and the lab)")
    revision: str | None = Field(None, description="Revision of a model id (a tag, a commit, or a ref "
                                                   "such as refs/pr/1)")

    @field_validator("revision")
    @classmethod
    def plain_revision(cls, value: str | None) -> str | None:
        # It names cache folders and object keys: plain parts only, never '..'.
        if value is not None and not re.fullmatch(REVISION_PATTERN, value) or value and ".." in value.split("/"):
            raise ValueError(f"{value!r} is not a revision: letters, digits, '.', '_', '-', and '/' between parts")
        return value
    params_b: Annotated[float, Field(gt=0)] | None = Field(
        None, description="Size in billions of parameters; inferred from the name when it says (8B, 70b)")


class MethodSpec(Strict):
    kind: Method = Method.lora
    rank: Annotated[int, Field(ge=1, le=1024)] | None = None
    alpha: Annotated[float, Field(gt=0)] | None = None
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.05
    target_modules: list[str] | None = None

    @field_validator("target_modules")
    @classmethod
    def module_names(cls, value: list[str] | None) -> list[str] | None:
        for name in value or []:
            if not re.fullmatch(r"[A-Za-z0-9_.]{1,128}", name, re.ASCII):
                raise ValueError(f"{name!r} is not a module name (like q_proj or mlp.down_proj)")
        return value


class ObjectiveSpec(Strict):
    kind: Objective = Objective.sft
    beta: Annotated[float, Field(gt=0)] | None = Field(None, description="DPO temperature (dpo only)")

    @model_validator(mode="after")
    def beta_only_for_dpo(self) -> ObjectiveSpec:
        if self.beta is not None and self.kind != Objective.dpo.value:
            raise ValueError("beta applies to the dpo objective only")
        return self


class DataSpec(Strict):
    train: str = Field(description="Training data: a local path or s3:// URL (JSONL, Parquet, CSV)")
    eval: str | None = None
    format: DataFormat = DataFormat.auto
    max_seq_len: Annotated[int, Field(ge=16, le=1_048_576)] = 2048
    eval_fraction: Annotated[float, Field(ge=0, lt=0.5)] = Field(
        0.02, description="Held out for evaluation when no eval set is given")
    too_long: str = Field("reject", pattern="^(reject|truncate)$")
    packing: bool | None = Field(None, description="Training examples packed into rows of up to max_seq_len "
                                                   "tokens, attention kept within each example; left open: on "
                                                   "for SFT, off for DPO (whose pairs are not packed)")

    @field_validator("train", "eval")
    @classmethod
    def data_location(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.strip() or any(ord(ch) < 32 for ch in value):
            raise ValueError("name a data file: a local path or an s3://bucket/key URL")
        if "://" in value and not is_s3_url(value):
            raise ValueError(f"{value!r}: only local paths and s3:// URLs are read")
        if is_s3_url(value):
            parse_s3_url(value, "a data file's S3 URL", needs_key=True)
        return value


class TrainingSpec(Strict):
    steps: Annotated[int, Field(ge=1)] | None = None
    epochs: Annotated[float, Field(gt=0)] | None = None
    learning_rate: Annotated[float, Field(gt=0, lt=1)] | None = None
    lr_schedule: str = Field("cosine", pattern="^(cosine|linear|constant)$")
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    micro_batch: Annotated[int, Field(ge=1)] = 1
    global_batch: Annotated[int, Field(ge=1)] | None = None
    precision: Precision | None = None
    seed: int = 42
    zero_stage: Annotated[int, Field(ge=0, le=3)] | None = None
    gradient_checkpointing: bool | None = None
    compile: bool | None = Field(None, description="regional torch.compile of the decoder layers; left open: "
                                                    "on on GPUs, off on CPUs and under ZeRO-3")
    max_grad_norm: Annotated[float, Field(gt=0)] = 1.0

    def compiled(self, on_gpu: bool) -> bool:
        """training.compile as given; left open, on for GPUs (measured to help there:
        benchmarks/GPU.md), off on CPUs (the lab's small models pay its compile time and gain little);
        never under ZeRO-3 (the schema refuses compile: true with an explicit ZeRO-3)."""
        if self.zero_stage == 3:
            return False
        return self.compile if self.compile is not None else on_gpu

    @model_validator(mode="after")
    def steps_or_epochs(self) -> TrainingSpec:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give steps or epochs, not both")
        if self.compile and self.zero_stage == 3:
            raise ValueError("compile: true is not offered with zero_stage: 3 (ZeRO-3 gathers each layer's "
                             "weights in hooks around it; ft has not proven them under a compiled layer): "
                             "drop compile, or use ZeRO-2")
        return self


class ResourceSpec(Strict):
    nodes: Annotated[int, Field(ge=1, le=4096)] = 1
    gpus_per_node: Annotated[int, Field(ge=0, le=64)] | None = None
    time: str = Field("04:00:00", description="Slurm time limit: [D-]HH:MM:SS or minutes")
    tier: Tier = Tier.standard
    account: str | None = None
    spare_nodes: Annotated[int, Field(ge=0, le=64, description="Extra nodes held: a lost node is replaced "
                                                              "at once, inside the allocation")] = 0

    @field_validator("time", mode="before")
    @classmethod
    def quoted_time(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool):
            # YAML reads `time: 90` as a number and `time: 72:00:00` as 259200 (base 60): ambiguous.
            raise ValueError(f"write the time limit in quotes (\"90\" minutes, \"72:00:00\"): YAML read {value} "
                             "as a number, and reads an unquoted 72:00:00 as seconds")
        return value

    @field_validator("time")
    @classmethod
    def slurm_time(cls, value: str) -> str:
        match = re.fullmatch(r"(?:([0-9]+)-)?([0-9]{1,3}):([0-9]{2}):([0-9]{2})|[0-9]+", value, re.ASCII)
        if not match:
            raise ValueError("use Slurm's format: [D-]HH:MM:SS, or minutes (e.g. 04:00:00, 1-12:00:00, 90)")
        days, hours, minutes, seconds = match.groups()
        if minutes is not None and (int(minutes) > 59 or int(seconds) > 59 or (days and int(hours) > 23)):
            raise ValueError(f"{value!r} is no time: minutes and seconds run to 59, and hours to 23 after a "
                             "day count (e.g. 04:00:00, 72:00:00, 3-00:00:00)")
        return value

    def time_limit_seconds(self) -> int:
        if ":" not in self.time:
            return int(self.time) * 60
        days, _, clock = self.time.rpartition("-")
        hours, minutes, seconds = (int(part) for part in clock.split(":"))
        return (int(days or 0) * 24 + hours) * 3600 + minutes * 60 + seconds

    @field_validator("account")
    @classmethod
    def account_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(NAME_PATTERN, value):
            raise ValueError("an account name is letters, digits, '.', '_' and '-'")
        return value


class CheckpointSpec(Strict):
    every_steps: Annotated[int, Field(ge=1)] | None = 100
    every_minutes: Annotated[float, Field(gt=0)] | Literal["auto"] | None = Field(None, description=(
        "Minutes between saves besides every_steps, or auto: the interval that loses the least time to saves "
        "and to work redone after failures (Young/Daly, from the measured save cost and the cluster's failure "
        "rate); unset: no saves by the clock"))
    keep_last: Annotated[int, Field(ge=1)] = 3
    staging: str | None = Field(None, description="Checkpoint folder on the shared filesystem "
                                                  "(default: the run directory)")
    s3_mirror: str | None = Field(None, description="s3:// prefix the checkpoints are mirrored to, shared by "
                                                    "every run of this recipe (a resubmission anywhere continues "
                                                    "from it); default: the cluster's s3_prefix, per run")
    before_time_limit: Annotated[int, Field(ge=60, le=65535)] = Field(300, description=(
        "Seconds before the job's time limit when Slurm signals the run to checkpoint and requeue itself: "
        "room for one save of this model to the shared filesystem (Slurm may signal up to a minute early)"))
    asynchronous: bool = Field(True, description="Training waits only for a copy of the state in host memory; "
                                                 "the write and the upload go on in the background (off: the "
                                                 "save waits for the write, and needs no extra host memory)")

    @field_validator("every_minutes", mode="before")
    @classmethod
    def minutes_as_float(cls, value):
        # 30 and 30.0 are the same cadence: stored as a float, so that it serializes as one.
        return float(value) if type(value) is int else value

    @field_validator("s3_mirror")
    @classmethod
    def s3_url(cls, value: str | None) -> str | None:
        if value is not None:
            parse_s3_url(value, "an S3 mirror")
        return value


class WatchdogSpec(Strict):
    """ft's watchdog inside the job: it notices a lost node, a dead rank or a hung one within seconds
    and restarts training from the latest checkpoint (see toolkit/watch/)."""
    enabled: bool = True
    heartbeat_timeout: Annotated[float, Field(ge=2, le=600, description=(
        "Seconds without a node's heartbeat before it counts as lost while its slurmd still answers (a "
        "node quiet for a second whose slurmd does not answer is lost at once)"))] = 10
    hang_factor: Annotated[float, Field(ge=2, le=1000, description="A rank is hung when its step is late by this "
                                                                   "many of its median step times (and by 3 of "
                                                                   "its longest)...")] = 10
    hang_floor: Annotated[float, Field(ge=5, le=86400, description="...and by at least this many seconds")] = 10
    startup_timeout: Annotated[float, Field(ge=30, le=86400, description="Seconds a start may take until the "
                                                                         "first step")] = 1800
    max_restarts: Annotated[int, Field(ge=0, le=100, description="Restarts inside the allocation before the "
                                                                 "job gives up")] = 5
    exclude_after_hangs: Annotated[int, Field(ge=1, le=100, description=(
        "Hangs blamed on one node (a rank of it stopped, or stuck in the kernel) before the job drains it "
        "and goes on without it: on a spare, or requeued without it"))] = 2
    max_requeues: Annotated[int, Field(ge=0, le=100, description="Requeues for lost nodes in a row without a new "
                                                                 "checkpoint before the job gives up (a run that "
                                                                 "goes on between losses is never given up on)")] = 3


class WandbSpec(Strict):
    project: str | None = None
    entity: str | None = None
    mode: str = Field("offline", pattern="^(online|offline|disabled)$")
    tags: list[str] = []


class TrackingSpec(Strict):
    wandb: WandbSpec = WandbSpec()
    log_every_steps: Annotated[int, Field(ge=1, le=1000, description=(
        "Steps between reads of the loss: one host synchronisation and one collective, and the NaN "
        "check with them. Every step's metrics are still recorded. A checkpoint, a stop and the last "
        "step read it first"))] = 10


class Metric(StrEnum):
    exact_match = "exact_match"  # the greedy completion equals the reference (whitespace-normalised)
    token_f1 = "token_f1"  # word overlap of completion and reference (SQuAD's F1): partial credit


class GateSpec(Strict):
    """What an adapter must show against the base model before it is promoted (each gate unset: not
    asked). Losses are mean negative log-likelihoods per labelled token (nats)."""
    held_out_loss_drop: Annotated[float, Field(ge=0)] | None = Field(
        None, description="The held-out loss at least this far below the base model's (0: any drop)")
    golden_loss_rise: Annotated[float, Field(ge=0)] | None = Field(
        None, description="The golden set's loss at most this far above the base model's")
    golden_metric_drop: Annotated[float, Field(ge=0, le=1)] | None = Field(
        None, description="Each task metric on the golden set at most this far below the base model's")

    def asked(self) -> bool:
        return any(value is not None for value in self.model_dump().values())


class EvalSpec(Strict):
    """Evaluation after training, in the same allocation: the held-out data and the golden set, with
    the trained model and the base model (measured before the first step), then the gates."""
    enabled: bool = True
    golden: str | None = Field(None, description="A fixed set the model must keep doing well on (same formats "
                                                 "as the training data): a local path or s3:// URL")
    metrics: list[Metric] = Field(default_factory=list, description="Task metrics on the golden set, from "
                                                                   "greedy completions of its prompts")
    max_examples: Annotated[int, Field(ge=1, le=1_000_000)] = Field(
        1000, description="At most this many examples of each set are evaluated")
    max_new_tokens: Annotated[int, Field(ge=1, le=4096)] = 64
    promote: bool = Field(True, description="Promote the adapter in the registry when every gate passes "
                                            "(with no gate asked, it stays a draft to promote by hand)")
    gates: GateSpec = GateSpec()

    @field_validator("golden")
    @classmethod
    def golden_location(cls, value: str | None) -> str | None:
        return DataSpec.data_location(value)

    @model_validator(mode="after")
    def golden_for_golden_gates(self) -> EvalSpec:
        if self.metrics and not self.golden:
            raise ValueError("metrics are measured on the golden set: name it (eval.golden)")
        if not self.golden and (self.gates.golden_loss_rise is not None or self.gates.golden_metric_drop is not None):
            raise ValueError("a golden-set gate needs the golden set: name it (eval.golden)")
        if self.gates.golden_metric_drop is not None and not self.metrics:
            raise ValueError("gates.golden_metric_drop compares task metrics: name them (eval.metrics: "
                             "[exact_match, token_f1])")
        return self


# The data files a recipe reads, by role: where each is named in the recipe (section, field).
DATA_FILES = {"train": ("data", "train"), "eval": ("data", "eval"), "golden": ("eval", "golden")}


class Recipe(Strict):
    name: str = Field(description="Names the run: letters, digits, '.', '_', '-'")
    model: ModelSpec
    method: MethodSpec = MethodSpec()
    objective: ObjectiveSpec = ObjectiveSpec()
    data: DataSpec
    training: TrainingSpec = TrainingSpec()
    resources: ResourceSpec = ResourceSpec()
    cluster: str | None = Field(None, description="Cluster profile (default: this site's, else lab)")
    checkpoint: CheckpointSpec = CheckpointSpec()
    watchdog: WatchdogSpec = WatchdogSpec()
    tracking: TrackingSpec = TrackingSpec()
    eval: EvalSpec = EvalSpec()
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for every rank")

    def data_files(self) -> dict[str, str]:
        """The data files the recipe names, by role (DATA_FILES)."""
        named = {role: getattr(getattr(self, section), field) for role, (section, field) in DATA_FILES.items()}
        return {role: path for role, path in named.items() if path}

    @model_validator(mode="after")
    def time_left_to_train(self) -> Recipe:
        limit = self.resources.time_limit_seconds()
        if self.checkpoint.before_time_limit >= limit:
            raise ValueError(f"checkpoint.before_time_limit ({self.checkpoint.before_time_limit} s) leaves no time "
                             f"to train within resources.time ({self.resources.time}, {limit} s): lengthen the "
                             "time limit or shorten the lead")
        return self

    @model_validator(mode="after")
    def held_out_data_for_its_gate(self) -> Recipe:
        if (self.eval.enabled and self.eval.gates.held_out_loss_drop is not None and not self.data.eval
                and not self.data.eval_fraction):
            raise ValueError("eval.gates.held_out_loss_drop needs held-out data: name an eval file (data.eval) "
                             "or hold some of the training data out (data.eval_fraction, e.g. 0.02)")
        return self

    @property
    def packed(self) -> bool:
        """data.packing as given; left open, on for SFT (toolkit/train/packing.py), off for DPO."""
        return self.data.packing if self.data.packing is not None else self.objective.kind == Objective.sft

    @model_validator(mode="after")
    def pairs_are_not_packed(self) -> Recipe:
        if self.data.packing and self.objective.kind == Objective.dpo:
            raise ValueError("data.packing: DPO compares each chosen answer with its rejected one, and ft does "
                             "not pack those pairs: drop data.packing (or set it to false)")
        return self

    @model_validator(mode="after")
    def spares_need_the_watchdog(self) -> Recipe:
        if self.resources.spare_nodes and not self.watchdog.enabled:
            raise ValueError("resources.spare_nodes needs the watchdog (watchdog.enabled: true): it is what "
                             "replaces a lost node with a spare")
        return self

    @field_validator("name")
    @classmethod
    def run_name(cls, value: str) -> str:
        if not re.fullmatch(NAME_PATTERN, value):
            raise ValueError(f"{value!r} cannot name a run: use 1-63 letters, digits, '.', '_' or '-', "
                             "starting with a letter or digit")
        return value

    @field_validator("env")
    @classmethod
    def env_entries(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            if not re.fullmatch(ENV_NAME_PATTERN, name, re.ASCII):
                raise ValueError(f"{name!r} is not a valid environment variable name")
            if RESERVED_ENV.fullmatch(name):
                raise ValueError(f"{name} is set by Slurm, the shell or ft itself; a recipe cannot change it")
            if SECRET_ENV_WORDS & set(name.upper().split("_")):
                raise ValueError(f"{name} looks like a secret: never put secrets in a recipe; export it in "
                                 "the shell you submit from and ft passes it by name")
            if "\0" in text:
                raise ValueError(f"the value of {name} holds a NUL character, which no environment can carry")
            if len(text.encode()) + len(name) + 1 > MAX_ENV_VALUE_BYTES:
                raise ValueError(f"the value of {name} is longer than 128 KiB, which Linux refuses at job start")
            if SECRET_VALUES.search(text):
                raise ValueError(f"the value of {name} holds what looks like a secret (a token, or a password in "
                                 "a URL): export it in the shell you submit from instead")
        return value

