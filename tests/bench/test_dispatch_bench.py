"""``ultraep.bench.dispatch`` on the CPU: its argument defaults and the per-destination
send counts the NCCL all_to_all_single baseline is given (the GPU run is the lead's)."""

import numpy as np

from ultraep.bench import dispatch as bench


def test_sends_per_rank_counts_a_token_once_per_destination_rank():
    rng = np.random.default_rng(3)
    ranks, experts_per_rank, top_k, tokens = 4, 3, 5, 200
    ids = np.stack([rng.choice(ranks * experts_per_rank, top_k, replace=False) for _ in range(tokens)])
    want = [sum(1 for t in range(tokens) if any(e // experts_per_rank == r for e in ids[t])) for r in range(ranks)]
    got = bench.sends_per_rank(np, ids, experts_per_rank, ranks)
    assert got == want
    assert sum(got) < tokens * top_k  # several experts of one token on one rank: fewer sends than pairs


def test_arguments():
    args = bench.parse_args(["--ranks", "8", "--tokens", "128", "--hidden", "256", "--repeats", "2"])
    assert (args.ranks, args.tokens, args.hidden, args.repeats, args.top_k) == (8, [128], [256], 2, 8)
