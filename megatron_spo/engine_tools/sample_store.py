"""`megatron-spo sample`: any model's samples, every one scored (failures kept), into an offline store.

    megatron-spo serve --model OTHER_CKPT --port 30001 &            # another policy (or pi_0 itself)
    megatron-spo sample --engine-url http://127.0.0.1:30001 --task toy --split train --n 8 \\
        --kind other-model --model OTHER_CKPT --temperature 1.0 --store stores/other
    megatron-spo sample ... --kind reference --temperature 1.6 --store stores/explore   # exploration decodings

Each record: the engine's token ids (prompt as training builds it, response as sampled), the reward train gives it
(the config's task.reward or --reward, else the task's built-in: 0 pass, -1 fail; failures kept: off-policy learners
need them), source "offline", and provenance {kind, model, temperature, top_p, origin "megatron-spo sample", run_id,
created}. Unlike estimate-q0, which keeps only pi_0's correct samples, this keeps what the data is: another policy's
successes and failures, or high-temperature decodings of pi_0 that its T=1 rollouts rarely produce.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_spo.data.prompts import Prompt
from megatron_spo.engine_tools.config import ToolSamplingConfig

ORIGIN = "megatron-spo sample"


async def sample_to_store(prompts: Sequence[Prompt], client: Any, reward_pool: Any, writer: Any, *, n: int,
                          sampling: ToolSamplingConfig, kind: str, model: str | None = None,
                          run_id: str | None = None) -> tuple[int, int]:
    """n samples per prompt, scored, every one added to ``writer`` (an OfflineStoreWriter) in prompt order.
    Returns (records, passing)."""
    from megatron_spo.data.trajectory import Provenance, Trajectory
    from megatron_spo.engine_tools.sampling import sample, score_all

    written = passed = 0
    for prompt in prompts:
        completions = await sample(client, prompt.tokens, n, sampling, seed_key=(prompt.prompt_id,))
        results = await score_all(reward_pool, prompt.problem, [c.text for c in completions])
        provenance = Provenance(kind=kind, model=model, run_id=run_id, origin=ORIGIN,
                                temperature=sampling.temperature, top_p=sampling.top_p, created=time.time())
        for c, r in zip(completions, results):
            if not c.output_ids:
                continue
            writer.add(Trajectory(prompt_id=prompt.prompt_id, prompt_tokens=list(prompt.tokens),
                                  response_tokens=list(c.output_ids), reward=float(r.reward), source="offline",
                                  policy_version=0, provenance=provenance))
            written += 1
            passed += bool(r.passed)
    return written, passed


def main(argv: list[str]) -> int:
    from megatron_spo.cli import positive_int
    from megatron_spo.config import build_config
    from megatron_spo.data.trajectory import PROVENANCE_KINDS
    from megatron_spo.engine_tools.command_line import (
        add_sampling_args,
        add_task_args,
        apply_train_config,
        close_reward_pool,
        prompts_from_args,
        reward_pool_from_args,
        run_cli,
        sampling_from_args,
    )

    parser = argparse.ArgumentParser(prog="megatron-spo sample", description=__doc__.split("\n\n")[0])
    add_task_args(parser, default_split="train")
    parser.add_argument("--store", required=True, help="offline store folder (created, or appended to)")
    parser.add_argument("--n", type=positive_int, default=8, help="samples per problem")
    parser.add_argument("--kind", default="other-model", choices=PROVENANCE_KINDS,
                        help="provenance kind: other-model (another policy), reference (pi_0, e.g. at a high "
                        "temperature: exploration)")
    parser.add_argument("--model", default=None, help="provenance model: the checkpoint the engine serves")
    parser.add_argument("--run-id", default=None, help="provenance run_id (this sampling's name)")
    add_sampling_args(parser, ToolSamplingConfig())
    args = parser.parse_args(argv)
    apply_train_config(args, parser)
    sampling = build_config(ToolSamplingConfig, sampling_from_args(args), "sample")

    async def body() -> int:
        from megatron_spo.data.offline_store import OfflineStoreWriter
        from megatron_spo.rollout.client import EngineClient

        prompts = prompts_from_args(args)
        pool = reward_pool_from_args(args, [p.problem for p in prompts], prog="sample")
        try:
            with OfflineStoreWriter(Path(args.store)) as writer:
                async with EngineClient(args.engine_url, timeout_s=args.request_timeout) as client:
                    written, passed = await sample_to_store(prompts, client, pool, writer, n=args.n,
                                                            sampling=sampling, kind=args.kind, model=args.model,
                                                            run_id=args.run_id)
        finally:
            close_reward_pool(pool)
        print(f"sample: {written} samples of {len(prompts)} problems into {args.store}: {passed} pass, "
              f"{written - passed} fail (T {sampling.temperature}, top-p {sampling.top_p}, kind {args.kind})")
        return 0

    return run_cli("megatron-spo sample", body)
