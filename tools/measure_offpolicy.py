"""What off-policy data with very low pi_0 log-probs does to SPO's loss (issue 48), on a quickstart reference.

    python tools/measure_offpolicy.py REF_DIR [--task toy_code] [--problems 16] [--samples 4] [--steps 30]

For the first --problems training problems it compares three kinds of responses: the expert's (data/expert.py, a
style pi_0 never saw), the task's own solutions (pi_0's SFT style) and pi_0's samples at T = 1 (transformers'
sampling; failures with r = -1). Per kind: log pi_0 per sequence and per token, the SPO terminal loss's (--loss, squared by default)
coefficient |dL/dQ_T| (squared: 2 |Q0 - r|) and the gradient norm of one batch of that kind at pi = pi_0 (where Q_T = Q0).
Then it trains a copy of pi_0 on the expert batch alone (Adam, --lr, --steps, clip 1) and prints Q_T (= the
residual, r = 0), the expert's log-ratio and the log-ratio of pi_0's own samples (how far the policy moved
elsewhere). Q0 per problem: beta log(S0 + (1 - S0) e^{-1/beta}) from the samples' success rate (S0 at least
0.5 / samples).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_spo.algorithms.spo import SPOInputs, q0_from_success, spo_loss, terminal_coefficients  # noqa: E402
from megatron_spo.data.expert import expert_solution  # noqa: E402
from megatron_spo.data.q0 import PAPER_BETA  # noqa: E402


def seq_logp(model, prompt: list[int], responses: list[list[int]]) -> torch.Tensor:
    """[B, T] token log-probs of each response after ``prompt`` (0 on padding), T = the longest response."""
    width = max(map(len, responses))
    ids = torch.zeros((len(responses), len(prompt) + width), dtype=torch.long)
    for i, r in enumerate(responses):
        ids[i, : len(prompt) + len(r)] = torch.tensor(prompt + r)
    logits = model(input_ids=ids).logits[:, len(prompt) - 1: -1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, len(prompt):, None])[..., 0]
    mask = torch.tensor([[t < len(r) for t in range(width)] for r in responses])
    return lp * mask, mask


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ref")
    ap.add_argument("--task", default="toy_code", choices=["toy_code", "toy_math"])
    ap.add_argument("--problems", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--beta", type=float, default=PAPER_BETA)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-coefficient", type=float, default=None, help="coefficient_clip's limit (off: unset)")
    ap.add_argument("--loss", default="squared", help="the SPO regression loss (algorithms/spo.py REGRESSION_LOSSES)")
    args = ap.parse_args()
    from functools import partial

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_spo.algorithms.spo_transforms import coefficient_clip
    from megatron_spo.data import toy_code, toy_math
    from megatron_spo.data.prompts import make_prompts
    from megatron_spo.rewards.math_answer import last_boxed

    torch.manual_seed(0)
    torch.set_num_threads(1)
    guard = [partial(coefficient_clip, limit=args.max_coefficient)] if args.max_coefficient else []
    tok = AutoTokenizer.from_pretrained(args.ref)
    ref = AutoModelForCausalLM.from_pretrained(args.ref, dtype=torch.float32).eval()
    task = (toy_code if args.task == "toy_code" else toy_math).make_task()
    problems = list(task.train[: args.problems])
    prompts = make_prompts(problems, tok)

    def correct(p, text: str) -> bool:
        if args.task == "toy_math":
            return last_boxed(text) == p.answer
        import contextlib
        import io

        for stdin, want in p.tests:
            out, old = io.StringIO(), sys.stdin
            sys.stdin = io.StringIO(stdin)
            try:
                with contextlib.redirect_stdout(out):
                    exec(compile(text.replace("```python", "").replace("```", ""), "<s>", "exec"), {})
            except BaseException:
                return False
            finally:
                sys.stdin = old
            if out.getvalue() != want:
                return False
        return True

    def enc(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    kinds: dict[str, list] = {"expert": [], "task solution": [], "own sample": []}  # (prompt, response, q0)
    s0s = []
    for p, pr in zip(problems, prompts):
        with torch.no_grad():
            out = ref.generate(torch.tensor([list(pr.tokens)]), do_sample=True, temperature=1.0, top_k=0,
                               max_new_tokens=args.max_new_tokens, num_return_sequences=args.samples,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        samples = []
        for row in out[:, len(pr.tokens):].tolist():
            row = row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
            samples.append((row, correct(p, tok.decode(row, skip_special_tokens=True))))
        s0 = sum(ok for _, ok in samples) / len(samples)
        s0s.append(s0)
        q0 = float(q0_from_success(torch.tensor(max(s0, 0.5 / len(samples))), args.beta))
        kinds["expert"].append((list(pr.tokens), enc(expert_solution(p)), q0, 0.0))
        kinds["task solution"].append((list(pr.tokens), enc(p.solutions[0]), q0, 0.0))
        kinds["own sample"] += [(list(pr.tokens), r, q0, 0.0 if ok else -1.0) for r, ok in samples]
    print(f"{args.task}: {len(problems)} problems, pi_0 S0 mean {statistics.fmean(s0s):.3f} ({args.samples} samples "
          f"each at T 1), beta {args.beta:.4f}")

    def batch_terms(model, rows, reference=None):
        lps, masks, refs = [], [], []
        for prompt, resp, *_ in rows:
            lp, m = seq_logp(model, prompt, [resp])
            lps.append(lp[0])
            masks.append(m[0])
            if reference is not None:
                with torch.no_grad():
                    refs.append(seq_logp(reference, prompt, [resp])[0][0])
        width = max(len(x) for x in lps)

        def pad(xs):
            return torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in xs])

        return pad(lps), pad(masks).bool(), pad(refs) if refs else None

    print("kind           n   log pi_0/seq  log pi_0/token  min token  |dL/dQ_T|  grad norm (batch at pi_0)")
    for name, rows in kinds.items():
        if not rows:
            print(f"{name:13s}  0")
            continue
        lp, mask, _ = batch_terms(ref, rows)
        per_seq = (lp * mask).sum(1)
        per_tok = per_seq / mask.sum(1)
        reward = torch.tensor([r for *_, r in rows])
        inputs = SPOInputs(lp, lp.detach(), mask, reward, torch.tensor([q for *_, q, _ in rows]))
        loss, _ = spo_loss(inputs, beta=args.beta, objective="terminal", loss=args.loss, transforms=guard)
        ref.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in ref.parameters() if p.grad is not None))
        coef = terminal_coefficients(inputs, beta=args.beta, objective="terminal", loss=args.loss).abs()
        coef = float(coef.clamp(max=args.max_coefficient or math.inf).mean())
        print(f"{name:13s} {len(rows):2d}  {per_seq.mean():12.1f}  {per_tok.mean():14.3f}  "
              f"{lp[mask].min():9.2f}  {coef:9.3f}  {gnorm:10.3f}")
    ref.zero_grad(set_to_none=True)

    def grad_of(rows) -> torch.Tensor:
        lp, mask, _ = batch_terms(ref, rows)
        reward = torch.tensor([r for *_, r in rows])
        inputs = SPOInputs(lp, lp.detach(), mask, reward, torch.tensor([q for *_, q, _ in rows]))
        loss, _ = spo_loss(inputs, beta=args.beta, objective="terminal", loss=args.loss, transforms=guard)
        ref.zero_grad(set_to_none=True)
        (loss * len(rows)).backward()  # a sum over sequences: mixed batches add
        return torch.cat([p.grad.flatten() for p in ref.parameters() if p.grad is not None])

    if kinds["own sample"]:  # a batch of pi_0's samples plus the expert rows: whose gradient is it?
        g_own, g_exp = grad_of(kinds["own sample"]), grad_of(kinds["expert"])
        g_mix = g_own + g_exp
        cos = torch.nn.functional.cosine_similarity
        print(f"mixed batch ({len(kinds['own sample'])} own samples + {len(kinds['expert'])} expert rows, summed): "
              f"|g_own| {g_own.norm():.2f}, |g_expert| {g_exp.norm():.2f}, cos(g_mix, g_own) "
              f"{cos(g_mix, g_own, 0):.3f}, cos(g_mix, g_expert) {cos(g_mix, g_exp, 0):.3f}")
        ref.zero_grad(set_to_none=True)

    policy = copy.deepcopy(ref).train()
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    rows = kinds["expert"]
    own = kinds["own sample"]
    print(f"SPO (terminal, {args.loss}, max_coefficient {args.max_coefficient}) on the expert batch alone, Adam lr "
          f"{args.lr}:")
    print("step  loss      Q_T = residual (r = 0)  expert log-ratio/seq  own-sample log-ratio/seq  grad norm")
    for step in range(args.steps + 1):
        lp, mask, rl = batch_terms(policy, rows, ref)
        inputs = SPOInputs(lp, rl, mask, torch.zeros(len(rows)), torch.tensor([q for *_, q, _ in rows]))
        loss, metrics = spo_loss(inputs, beta=args.beta, objective="terminal", loss=args.loss, transforms=guard)
        ratio = ((lp - rl) * mask).sum(1).detach()
        q_t = torch.tensor([q for *_, q, _ in rows]) + args.beta * ratio
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0))
        if step % max(1, args.steps // 6) == 0 or step == args.steps:
            with torch.no_grad():
                olp, omask, orl = batch_terms(policy, own, ref) if own else (None, None, None)
                own_ratio = float(((olp - orl) * omask).sum(1).mean()) if own else float("nan")
            print(f"{step:4d}  {loss.item():.5f}  {q_t.mean():22.4f}  {ratio.mean():20.3f}  "
                  f"{own_ratio:24.3f}  {gnorm:9.3f}")
        if step < args.steps:
            opt.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
