"""One rank of a distributed test run (started by mlx.launch from test_distributed.py).

    python distributed_rank.py JOB.json

JOB lists cases {source, target, translator, wire, prompt, max_tokens}; every rank runs them
in order, rank 0 writes each case's token ids and switch figures to JOB's "out" file.
Set KVLINGO_TEST_DIE_AT=<rank>:<case index> to make that rank exit abruptly before a case.
"""

import json
import os
import sys

import mlx_kvlingo  # noqa: F401  (preloads OpenBLAS before mlx)
from mlx_kvlingo import distributed as dist


def main(job_path):
    job = json.loads(open(job_path).read())
    group = dist.init(timeout=job.get("timeout", 60))
    die = os.environ.get("KVLINGO_TEST_DIE_AT")
    results = []
    for i, case in enumerate(job["cases"]):
        if die and die == f"{group.rank()}:{i}":
            os._exit(7)
        sp = dist.load_sharded_pair(
            case["source"], case["target"], case["translator"], group,
            wire=case.get("wire", "auto"), timeout=job.get("timeout", 60),
        )  # fmt: skip
        tokens = sp.tokenizer.encode(case["prompt"]) if sp.rank == 0 else None
        request = dist.broadcast_request(sp, tokens)
        tokens, _ = request
        h = dist.handoff(sp, tokens)
        out = [
            int(r.token)
            for r in dist.decode(sp, tokens[-1:], h.target_cache, max_tokens=case["max_tokens"])
        ]
        results.append({
            "tokens": out, "wire": h.wire, "bytes": h.bytes_sent, "owners":
            [[o.start, o.stop] for o in sp.owners], "local_layers": len(sp.target.layers),
        })  # fmt: skip
    if group.rank() == 0:
        with open(job["out"], "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
