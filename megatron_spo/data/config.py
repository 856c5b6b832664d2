"""The task's configs: which prompts (a task kind or the generated toy task) and which offline records
(by provenance) a run reads."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AliasPath, Field, model_validator

from megatron_spo.config import ConfigView, StrictModel


def _generated_task(value: str) -> str:
    from megatron_spo.data.tasks import GENERATED_TASKS

    if value not in GENERATED_TASKS:
        raise ValueError(f"unknown generated task '{value}' (choose from {', '.join(GENERATED_TASKS)})")
    return value


class ToyCodeTaskConfig(StrictModel):
    """The generated task: code pipelines (kind toy_code, data/toy_code.py) or arithmetic word problems (toy_math,
    data/toy_math.py); problems, tests per problem, the split. A bare name is read as the kind
    (``task=toy_math`` = ``task.kind=toy_math``)."""

    kind: Annotated[str, AfterValidator(_generated_task)] = Field(
        "toy_code", description="toy_code | toy_math (data/tasks.py GENERATED_TASKS)")
    seed: int = 0
    num_problems: int = Field(240, ge=6)
    heldout_fraction: float = Field(0.5, gt=0, lt=1, description="120 held-out problems by default: enough for a "
                                    "95% interval of about +-0.05 on pass@1")
    num_tests: int = Field(5, gt=0, description="reward tests per problem (toy_code)")
    num_hidden_tests: int = Field(5, gt=0, description="evaluation-only tests per problem (toy_code)")
    max_solutions: int = Field(16, gt=0, description="reference solutions kept per problem")
    num_sft_problems: int = Field(900, ge=0, description="extra problems seen only in SFT (teach the prompt language)")

    @model_validator(mode="before")
    @classmethod
    def _bare_kind(cls, data: Any) -> Any:
        return {"kind": data} if isinstance(data, str) else data


def _task_kind(value: str) -> str:
    from megatron_spo.data.tasks import TASK_ALIASES, TASK_KINDS, task_kind_name

    if task_kind_name(value) not in TASK_KINDS:
        raise ValueError(f"unknown task kind '{value}' (choose from {', '.join(TASK_KINDS)}; {TASK_ALIASES})")
    return task_kind_name(value)


TaskKindName = Annotated[str, AfterValidator(_task_kind)]


class ProvenanceSelect(StrictModel):
    """Which records of an offline source to train on, by provenance (data/trajectory.py Provenance): each
    given list must contain the record's value (None = any). assume_kind: the kind of records without
    provenance (stores written before it existed)."""

    kinds: list[str] | None = None
    models: list[str] | None = None
    run_ids: list[str] | None = None
    assume_kind: str | None = None


class TaskConfig(StrictModel):
    """The prompts of the online source, and their Q0 estimates."""

    kind: TaskKindName = "codecontests"
    reward: str | None = Field(None, description="a custom reward hook 'package.module:function' (problem, "
                               "completion_text) -> float, used for every problem instead of the kind's own")
    paths: list[str] = Field(default_factory=list, description="parquet / jsonl files or datasets save_to_disk "
                             "folders (not for 'toy')")
    input_key: str | None = Field(None, description="verl / slime / trl / hf: the prompt column (slime's --input-key; "
                                  "default: 'prompt', slime's 'input')")
    label_key: str | None = Field(None, description="slime / trl / hf: the reference answer (or tests) column "
                                  "(slime's --label-key; trl's default 'solution')")
    metadata_key: str = Field("metadata", description="slime / hf: the metadata column (slime's --metadata-key)")
    reward_kind: Literal["code", "math", "gsm8k"] | None = Field(
        None, description="verl / slime / trl / hf: the built-in reward of the rows (verl: by data_source when "
        "unset; the others: math); a task.reward hook replaces it")
    instruction: str | None = Field(None, description="appended to every problem's statement in place of its kind's "
                                    "(math: 'Reason step by step, and put your final answer within \\boxed{}.'; code: "
                                    "the stdin/stdout instruction); '' appends none. Every command reading this task "
                                    "(train, estimate-q0, eval, pts, sample) builds its prompts with it. Unset: each "
                                    "problem's own (a JSONL row's instruction), else its kind's")
    dedup_against: list[str] = Field(default_factory=list, description="TACO test files to remove from training")
    toy: ToyCodeTaskConfig = Field(default_factory=ToyCodeTaskConfig)
    q0_path: str | None = Field(None, description="estimate-q0 output (prompt_id -> Q0): SPO needs one for every "
                                "online prompt and every offline record without q0, else it refuses to start")
    q0_prior: float = Field(0.5, ge=0, description="Q0 from q0_path's counts: each prompt's success rate as the "
                            "posterior mean under a Beta(q0_prior, q0_prior) prior, (correct + q0_prior) / (n + 2 "
                            "q0_prior): 0.5 = Jeffreys' (0 of 12 successes: Q0 -0.283 at the paper's beta, not -1); "
                            "0 = the plain rate (data/q0.py)")
    max_prompt_tokens: int = Field(2048, gt=0)
    limit: int | None = Field(None, gt=0, description="use only the first N training problems")

    @model_validator(mode="after")
    def _toy_kind_agrees(self) -> TaskConfig:
        from megatron_spo.data.tasks import GENERATED_TASKS

        generated = self.kind in GENERATED_TASKS.values()
        if generated and "kind" in self.toy.model_fields_set and GENERATED_TASKS[self.toy.kind] != self.kind:
            raise ValueError(f"task.toy.kind '{self.toy.kind}' is not task.kind '{self.kind}' (the generated "
                             f"tasks are {', '.join(f'{k}: kind {v}' for k, v in GENERATED_TASKS.items())})")
        return self


class TrainTaskView(ConfigView):
    """What the data importers read of a training config: its task and the policy's tokenizer (init.hf)."""

    task: TaskConfig = Field(default_factory=TaskConfig)
    init_hf: str | None = Field(None, validation_alias=AliasPath("init", "hf"))
