"""The docs' screenshot of the server's web page: a real server, a real headless browser, a real conversation.

Starts ``speculant serve`` (a subprocess, on a free port) with ``--target``, opens ``/`` in Debian's headless
chromium through chromedriver (tests/webdriver.py: W3C WebDriver over HTTP), types a request, waits for the
streamed answer and its statistics, then (with ``--follow-up``) a second request in the same conversation, and
writes the screenshot and what the page showed (JSON) to ``--out``.

    apt install chromium chromium-driver
    python benchmarks/page_screenshot.py --target smollm2-135m-instruct --out benchmarks/results/serve-page
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from webdriver import Browser  # noqa: E402

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."
FOLLOW_UP = "Now show how to call it for n = 10."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--follow-up", default=FOLLOW_UP, help="a second request in the conversation ('' for none)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--height", type=int, default=1200, help="the window's height in pixels (the screenshot's)")
    ap.add_argument("--out", default="benchmarks/results/serve-page")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Path(tempfile.gettempdir()) / "speculant-page-server.log"  # the server's stderr (not a result)
    with log.open("w") as err:
        server = subprocess.Popen([sys.executable, "-m", "speculant", "serve", "--target", args.target, "--port", "0",
                                   "--threads", str(args.threads)], stdout=subprocess.DEVNULL, stderr=err)
    try:
        url = None
        deadline = time.time() + 600
        while url is None or httpx.get(url + "/health", timeout=5).status_code != 200:
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit(f"the server did not come up: {log.read_text()[-2000:]}")
            match = re.search(r"at (http://\S+)/v1", log.read_text())
            url = match.group(1) if match else None
            time.sleep(0.5)
        with Browser(width=1100, height=args.height) as b:
            b.open(url + "/")
            b.wait("return document.getElementById('model').textContent.length > 0 && "
                   "!document.getElementById('model').textContent.startsWith('loading')", what="the model list")
            b.js(f"document.getElementById('max').value = '{args.max_tokens}'")
            prompts = [args.prompt] + ([args.follow_up] if args.follow_up else [])
            for turn, prompt in enumerate(prompts, 1):
                b.type("#prompt", prompt)
                b.click("#send")
                b.wait(f"return document.querySelectorAll('.meta').length === {turn} && "
                       f"document.querySelectorAll('.meta')[{turn - 1}].textContent.length > 0 && "
                       "!document.getElementById('send').disabled", timeout=600, what=f"answer {turn}")
            shown = {k: b.js(f"return document.getElementById('{k}').textContent")
                     for k in ("model", "tau", "tps", "share", "ntok", "final")}
            shown["answers"] = b.js("return Array.from(document.querySelectorAll('.meta'), m => m.textContent)")
            shown["draft_spans"] = b.js("return document.querySelectorAll('.assistant .draft').length")
            shown["code_blocks"] = b.js("return document.querySelectorAll('.assistant pre code.hljs').length")
            b.js("const log = document.getElementById('log'), users = log.querySelectorAll('.user');"
                 "const last = users[users.length - 1];"  # the last request near the top, the earlier meta above
                 "log.scrollTop = last.offsetTop - log.offsetTop - 60;")
            b.screenshot(out / "page.png")
        shown.update(prompts=prompts, target=args.target, threads=args.threads, max_tokens=args.max_tokens)
        (out / "page.json").write_text(json.dumps(shown, indent=1, ensure_ascii=False))
        print(json.dumps(shown, ensure_ascii=False))
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
