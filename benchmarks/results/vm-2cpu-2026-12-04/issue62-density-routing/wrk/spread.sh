#!/bin/bash
# usage: spread.sh TREE [extra server args]; runs one then rot (20 models) wrk 15s each, 16 conns
T=$1; shift
source /work/main/.venv/bin/activate
cd $T
PYTHONPATH=$T python -m service.cli --model-repository /tmp/exp/repo20 --device cpu --port 8311 "$@" > /tmp/exp/server.log 2>&1 &
SP=$!
for i in $(seq 1 240); do curl -sf localhost:8311/ready >/dev/null && break; sleep 1; done
for m in $(seq -f "m%03g" 1 20); do curl -s -o /dev/null -X POST --data-binary @/tmp/exp/coffee.jpg -H 'Content-Type: image/jpeg' "localhost:8311/predict?model=$m"; done
wrk -t2 -c16 -d5s -s /tmp/exp/rot.lua http://127.0.0.1:8311 >/dev/null
for arm in one rot one rot; do
  echo -n "$arm "; wrk -t2 -c16 -d15s -s /tmp/exp/$arm.lua http://127.0.0.1:8311 | grep -E "Requests/sec" 
done
kill $SP; wait $SP
