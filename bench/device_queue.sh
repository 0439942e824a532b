#!/usr/bin/env bash
# A queue of bench commands on a lent GPU machine that outlives one device call (each call may run 10 minutes; the
# machine stays warm between calls made within its idle window). Run from the checkout's root on the device:
#
#   JOBS="parity_sd15 sd15 grpo" WAIT=560 bash bench/device_queue.sh      # the first call: install, start, wait
#   WAIT=560 bash bench/device_queue.sh                                # the next calls: wait and collect
#
# The first call copies the checkout to /tmp/w, installs the carried wheels (.whl-dpo or .whl-min, then
# .whl-unsloth/peer.tar.gz when carried) into /tmp/site (QUEUE_ROOT=DIR: DIR instead of /tmp), and starts the jobs
# in a session of their own, one after the other, each a `job_NAME` function of bench/device_jobs.sh (JOBS_FILE=
# another file). Each call then waits until every job is done or WAIT seconds have passed, and copies /tmp/res (each job's .txt and .json, the queue's
# log) to $OUT/res. A machine given back between calls loses its queue: the next call finds no queue and starts
# JOBS again, so name only the jobs not yet collected.
set -u
Q=${QUEUE_ROOT:-/tmp}  # where the copy, the installed packages, the results and the queue's marks go
R=$Q/res
start=$(date +%s)
if [ ! -f "$Q/queue.started" ]; then
    [ -n "${JOBS:-}" ] || { echo "device_queue.sh: no queue is running; name the jobs: JOBS=\"a b\" (bench/device_jobs.sh)" >&2; exit 2; }
    rm -rf "$Q/w" && mkdir -p "$Q/w" "$R" "$Q/peer" && cp -a . "$Q/w/" && cd "$Q/w" || exit 1
    wheels=$(ls -d .whl-dpo .whl-min 2>/dev/null | head -1)
    if [ -n "$wheels" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$Q/site" \
            "$wheels"/*.whl || exit 1
    fi
    if [ -f .whl-unsloth/peer.tar.gz ]; then tar xzf .whl-unsloth/peer.tar.gz -C "$Q/peer" || exit 1; fi
    cat > "$Q/queue.sh" <<EOS
export PYTHONPATH=$Q/site:$Q/w R=$R PYTHONPYCACHEPREFIX=$Q/pyc
cd $Q/w && source ${JOBS_FILE:-bench/device_jobs.sh}
if [ "${BYTECODE:-1}" = 1 ]; then  # BYTECODE=0: the queue's own test, which has no time for it
    # Bytecode for every package and the checkout, as a user's pip install keeps it: the wheels above go in with
    # --no-compile, and the machine's own packages may come without __pycache__ (start-up times count imports).
    echo "bytecode: \$(find "\$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')" -name '*.pyc' | wc -l) .pyc files under torch before" > $R/bytecode.txt
    python3 -m compileall -q -j 0 \$(python3 -c "import sys; print(' '.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))") $Q/site $Q/w/toolkit $Q/w/bench > /dev/null 2>&1
    echo "compiled into $Q/pyc: \$(find $Q/pyc -name '*.pyc' | wc -l) files" >> $R/bytecode.txt
fi
for job in $JOBS; do
    echo "\$(date +%T) start \$job" >> $R/queue.log
    job_\$job; rc=\$?
    echo "\$(date +%T) end \$job rc=\$rc" >> $R/queue.log
done
touch $R/all.done
EOS
    touch "$Q/queue.started"
    setsid nohup bash "$Q/queue.sh" > "$R/queue.out" 2>&1 < /dev/null &
    nvidia-smi -L 2>/dev/null; df -h "$Q" | tail -1
else
    echo "the queue started by an earlier call is running"
fi
while [ ! -f "$R/all.done" ] && [ $(( $(date +%s) - start )) -lt "${WAIT:-560}" ]; do sleep 5; done
mkdir -p "$OUT/res" && cp -r "$R"/* "$OUT/res/" 2>/dev/null
cat "$R/queue.log" 2>/dev/null
for f in "$R"/*.txt; do [ -f "$f" ] && { echo "== $f"; tail -c 1500 "$f"; }; done
