#!/bin/bash
cd /work/main
S=.venv/bin/speculant
OUT=/tmp/b/os
up() { for i in $(seq 120); do sleep 2; curl -s http://127.0.0.1:$1/health | grep -q '"ok"' && return 0; done; return 1; }
bench() { $S bench serve --url http://127.0.0.1:$1 --concurrency 1 --requests 32 --prompts builtin:code-chat-train --max-tokens 128 --temperature 0 --warmup 2 --out $OUT/$2 > $OUT/$2.log 2>&1; }
for round in 1 2; do
  $S serve --target smollm2-135m-instruct --threads 2 --port 8031 > $OUT/plain$round.srv 2>&1 &
  P=$!; up 8031; bench 8031 plain-bench$round; kill $P; wait $P
  rm -rf $OUT/state$round
  $S serve --target smollm2-135m-instruct --threads 2 --port 8032 --online --online-every 16 --online-state $OUT/state$round > $OUT/online$round.srv 2>&1 &
  P=$!; up 8032
  $S bench serve --url http://127.0.0.1:8032 --concurrency 1 --requests 32 --prompts builtin:code-chat-train --max-tokens 64 --warmup 0 --out $OUT/train$round > $OUT/train$round.log 2>&1
  sleep 30; curl -s http://127.0.0.1:8032/metrics | grep -E "online_updates_total|online_drafter_version" > $OUT/online$round.metrics
  bench 8032 online-bench$round
  curl -s http://127.0.0.1:8032/metrics | grep -E "online_updates_total|online_drafter_version" >> $OUT/online$round.metrics
  kill $P; wait $P
done
echo done > $OUT/DONE
