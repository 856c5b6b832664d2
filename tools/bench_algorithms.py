"""Costs inside the math core, as ratios measured in one run.

    python tools/bench_algorithms.py [--batch 32] [--tokens 1024] [--device cpu|cuda]

1. Input validation (one fused finiteness / empty-row probe, one device sync) relative to a whole loss
   call (forward + backward) at LLM-like batch shapes.
2. GAE as a chunked scan (megatron_spo.algorithms.gae) against the textbook per-token loop.
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_spo.algorithms import SPOInputs, agro_loss, check_token_inputs, gae, spo_loss


def gae_loop(rewards, values, mask, gamma, lam):
    """The per-token recursion, one step per position (contiguous masks)."""
    fvalid = mask.to(values.dtype)
    rewards, values = rewards * fvalid, values * fvalid
    adv = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in range(values.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = (delta + gamma * lam * next_adv) * fvalid[:, t]
        adv[:, t] = next_adv
        next_value = values[:, t]
    return adv


def timed(fn, repeats: int, device: str) -> float:
    fn()  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    b, t, dev = args.batch, args.tokens, args.device
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(b, t, generator=gen)).to(dev).requires_grad_(True)
    ref = (-torch.rand(b, t, generator=gen)).to(dev)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(dev)
    reward = -torch.randint(0, 2, (b,), generator=gen).float().to(dev)
    q0 = torch.full((b,), -0.5, device=dev)
    group = (torch.arange(b) // 8).to(dev)

    def check():
        check_token_inputs("bench", mask, {"logp": logp, "ref_logp": ref}, {"reward": reward, "q0": q0})

    def spo(objective, loss):
        def run():
            value, _ = spo_loss(SPOInputs(logp, ref, mask, reward, q0), beta=0.5, objective=objective, loss=loss)
            value.backward()

        return run

    def agro():
        value, _ = agro_loss(logp, ref, mask, reward, group, beta=0.5, on_policy=False)
        value.backward()

    t_check = timed(check, args.repeats, dev)
    print(f"shape [{b}, {t}] on {dev}: validation / whole loss call (forward + backward)")
    for name, fn in [
        ("spo terminal/squared", spo("terminal", "squared")),
        ("spo reverse_q/cross_entropy", spo("reverse_q", "cross_entropy")),
        ("agro off-policy", agro),
    ]:
        t_loss = timed(fn, args.repeats, dev)
        print(f"  {name:28s} validation is {t_check / t_loss:6.1%} of the call")

    rewards, values = torch.randn(b, t, generator=gen).to(dev), torch.randn(b, t, generator=gen).to(dev)
    scan, _ = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    loop = gae_loop(rewards, values, mask, 1.0, 0.95)
    t_scan = timed(lambda: gae(rewards, values, mask, gamma=1.0, lam=0.95), args.repeats, dev)
    t_loop = timed(lambda: gae_loop(rewards, values, mask, 1.0, 0.95), max(1, args.repeats // 4), dev)
    diff = float((scan - loop).abs().max())
    print(
        f"gae [{b}, {t}]: per-token loop / chunked scan = {t_loop / t_scan:.1f}x (max |difference| {diff:.1e})"
    )


if __name__ == "__main__":
    main()
