"""Where vLLM's CPU kernel puts K and V in a tile (run in the e2e venv; prints JSON).

For each (ISA, dtype, block size, head size) it writes random K and V for every slot of
two blocks with ``cpu_attn_reshape_and_cache`` and counts the tokens whose K or V are
not where kvpush_vllm/_tensors.py says the ``vec`` ISAs keep them (K channel-major:
value ``c`` of token ``t`` at ``c * block_size + t``; V token-major, after the K half).
A configuration the kernel refuses on this CPU (AMX without AMX tiles) is a row with
``refused``: the message.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main() -> None:
    import torch
    from vllm import _custom_ops as ops

    out = []
    for isa, dtype in (("vec", torch.float32), ("vec16", torch.float32), ("amx", torch.bfloat16)):
        for bs in (32, 64):
            for hs in (64, 128):
                heads, nb = 2, 3
                torch.manual_seed(bs + hs)
                n = 2 * bs
                key = torch.randn(n, heads, hs).to(dtype)
                val = torch.randn(n, heads, hs).to(dtype)
                kv = torch.zeros(nb, heads, bs, 2 * hs, dtype=dtype)
                kc, vc = kv.view(nb, heads, 2 * bs, hs).chunk(2, dim=2)
                slots = torch.arange(n, dtype=torch.int64) + bs  # blocks 1 and 2
                row = {"isa": isa, "dtype": str(dtype), "block_size": bs, "head_size": hs}
                try:
                    ops.cpu_attn_reshape_and_cache(key, val, kc, vc, slots, isa)
                except RuntimeError as e:  # e.g. AMX on a CPU without AMX tiles
                    out.append({**row, "refused": str(e)})
                    continue
                tiles = kv.view(nb, heads, -1)
                bad_k = bad_v = 0
                for t in range(n):
                    b, o = divmod(t + bs, bs)
                    for h in range(heads):
                        k = tiles[b, h, torch.arange(hs) * bs + o]
                        v = tiles[b, h, bs * hs + o * hs : bs * hs + (o + 1) * hs]
                        bad_k += not torch.equal(k, key[t, h])
                        bad_v += not torch.equal(v, val[t, h])
                out.append({**row, "rows": n * heads, "bad_k": bad_k, "bad_v": bad_v})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
