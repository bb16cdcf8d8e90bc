"""Whether every concurrent greedy response equals the same request served alone (one running server).

Sends N MT-Bench first turns (96 tokens, greedy) to a running ``speculant serve`` one at a time, then the same N
from four clients at once (the server batches them), and compares the answers (token ids where the server returns
them, else the text). Writes ``{"requests", "identical", "differ"}`` to OUT.

    speculant serve --target smollm2-135m-instruct --max-batch 4 --port 8051 &
    python benchmarks/serve_identical.py http://127.0.0.1:8051 24 identical.json
"""
import argparse
import json
import threading

import httpx

from speculant.data.prompts import load_prompts

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("url", help="the running server, e.g. http://127.0.0.1:8051")
ap.add_argument("n", type=int, help="how many MT-Bench first turns to send")
ap.add_argument("out", help="the JSON file to write")
args = ap.parse_args()
url, n, out = args.url, args.n, args.out
rows = load_prompts("builtin:mt-bench", n)
def ask(r):
    body = {"model": "smollm2-135m-instruct", "messages": [r["messages"][0]] if "messages" in r else [{"role": "user", "content": r["prompt"]}],
            "max_tokens": 96, "temperature": 0, "return_token_ids": True}
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    resp.raise_for_status()
    c = resp.json()["choices"][0]
    return c.get("token_ids") or c["message"]["content"]
alone = [ask(r) for r in rows]
together = [None] * n
def worker(i0):
    for i in range(i0, n, 4):
        together[i] = ask(rows[i])
ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
[t.start() for t in ts]; [t.join() for t in ts]
same = sum(a == b for a, b in zip(alone, together))
json.dump({"requests": n, "identical": same, "differ": [i for i, (a, b) in enumerate(zip(alone, together)) if a != b]}, open(out, "w"), indent=1)
print(f"{same}/{n} identical")
