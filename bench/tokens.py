"""Capability tokens: what the checks cost a job.

  guarded_step_overhead  the built-in trainer's step (`workers/trainer/loop.py`
                         `train`, as bench/metrics.py runs it: 2 gloo ranks on this
                         machine, one torch thread each, no Ray, no Redis) with
                         every guarded call asking the rank's capability token
                         (`workers/collectives.py` `permit`: the interface on the
                         token's whitelist, the group in its scope, the token not
                         expired or withdrawn), against the same run with the
                         check skipped (every `permit` allowed unasked): the path
                         a job's rank takes, not a wrapper. Median step time after
                         the warm-up steps, runs alternating, medians over the
                         repeats. Target 1.02. Stderr gives the guarded calls per
                         step (counted in one extra run) and one check's cost, so
                         the guard's share of a step can be read off directly.
  token_verify_us        one verification of a kuangchao token (Ed25519 signature,
                         claims, expiry, revocation lookup), the median over many;
                         against PyJWT's HS256 check of the same claims with a
                         shared secret (the one-cluster-token design kuangchao does
                         not use: anyone who can check such a token can mint one).
                         Informative, no target.

Run: .venv/bin/python bench/tokens.py [--repeats 5] [--steps 120] [--quick]
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

import jwt  # noqa: E402

from bench.harness import emit, log, median, spread_of, wait_for_quiet  # noqa: E402
from bench.metrics import WARMUP_STEPS, one_run, step_times  # noqa: E402
from kuangchao.platform.security.tokens import (  # noqa: E402
    Minter,
    Scope,
    Verifier,
    generate_key,
    load_public,
    public_pem,
)

SCOPE = Scope(devices=(0,), groups=("world",), checkpoint_prefix="/ckpt/bench",
              redis_prefix="kc:job:bench:")


def guarded_steps(repeats: int, steps: int) -> tuple[list[float], list[float], float]:
    """Step times with the token check and without; guarded calls per step."""
    times: dict[str, list[float]] = {"counted": [], "guarded": [], "unguarded": []}
    for i in range(repeats):
        # Alternate who goes first so drift and warm caches favour neither side.
        for variant in ("guarded", "unguarded") if i % 2 == 0 else ("unguarded", "guarded"):
            wait_for_quiet()
            # metrics.py's "off": no telemetry, the token checked as in a job.
            stamps, _, others = one_run("off" if variant == "guarded" else variant, steps)
            med, _ = step_times(stamps)
            times[variant].append(med)
            log(f"repeat {i} {variant:9s}: step median {med * 1e3:.2f} ms; other processes "
                f"busy {others:.2f} cores")
    extras: dict[str, int] = {}
    one_run("counted", steps, extras)
    per_step = extras["guard_calls"] / steps
    return times["guarded"], times["unguarded"], per_step


def check_us(n: int = 20000) -> float:
    """One `permit` with a valid token, in microseconds (the guard's own work)."""
    from kuangchao.workers import collectives

    _, claims = Minter(generate_key()).mint("bench/rank-0", "bench", "trainer", SCOPE,
                                            ["all_reduce"], 3600)
    collectives.set_token(claims)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            collectives.permit("all_reduce")
        return (time.perf_counter() - t0) / n * 1e6
    finally:
        collectives.set_token(None)


def verify_us(n: int = 2000) -> tuple[float, float]:
    key = generate_key()
    token, _ = Minter(key).mint("bench/rank-0", "bench", "trainer", SCOPE, ["all_reduce"], 3600)
    revoked: set[str] = set()
    verifier = Verifier(load_public(public_pem(key)), is_revoked=revoked.__contains__)
    secret = secrets.token_bytes(32)
    payload = jwt.decode(token, options={"verify_signature": False})
    shared = jwt.encode(payload, secret, algorithm="HS256")

    def per_call(fn) -> float:
        samples = []
        for _ in range(10):
            t0 = time.perf_counter()
            for _ in range(n // 10):
                fn()
            samples.append((time.perf_counter() - t0) / (n // 10) * 1e6)
        return statistics.median(samples)

    ours = per_call(lambda: verifier.verify(token))
    theirs = per_call(lambda: jwt.decode(shared, secret, algorithms=["HS256"], issuer="kuangchao"))
    return ours, theirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--quick", action="store_true",
                    help="one short run of each side: checks the script works (seconds)")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.steps = 1, WARMUP_STEPS + 6
    if args.steps < WARMUP_STEPS + 3:
        ap.error(f"--steps must be at least {WARMUP_STEPS + 3}")
    t0 = time.monotonic()
    guarded, unguarded, per_step = guarded_steps(args.repeats, args.steps)
    one = check_us()
    log(f"built-in trainer step: guarded {spread_of(guarded)} s, unguarded {spread_of(unguarded)} s")
    log(f"guarded calls per step {per_step:.1f} x {one:.2f} us a check = "
        f"{per_step * one:.1f} us of guard work a step")
    emit("tokens", "guarded_step_overhead", "s", median(guarded), median(unguarded), 1.02,
         better="lower", target_on="ratio", spread={"ours": guarded, "baseline": unguarded},
         guarded_calls_per_step=round(per_step, 2), check_us=round(one, 3),
         settings="baseline: the same trainer run with every permit() allowed unasked")
    ours, theirs = verify_us(400 if args.quick else 2000)
    log(f"token verification: Ed25519 {ours:.1f} us, HS256 shared secret {theirs:.1f} us")
    emit("tokens", "token_verify_us", "us", ours, theirs, None, better="lower", target_on="ratio",
         settings="baseline: PyJWT HS256 decode of the same claims with a 32-byte shared secret")
    log(f"total wall time {time.monotonic() - t0:.1f}s")


if __name__ == "__main__":
    main()
