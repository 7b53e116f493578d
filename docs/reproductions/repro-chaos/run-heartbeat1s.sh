#!/bin/sh
# repro-chaos with a 1 s heartbeat expiry (--heartbeat-ms 1000; run.sh's runs use the default,
# 3 s): the same 4 ftdiloco groups, link, spares and window as run.sh; 1 kill a minute from the
# four fault seeds, 4 a minute, and one fault-free run (to show that no live group is dropped).
# Needs root.
set -e
OUT=${OUT:-runs/repro-chaos}
FIG=${FIG:-docs/reproductions/repro-chaos/heartbeat1s}
COMMON="--groups 4 --hosts 2 --rate 100mbit --duration 180 --every 32 --recovery 5 --warm-spare 2
        --model bert-tiny --compressor topk:ratio=0.01,ef=true --batch-size 8 --seq-len 64 --heartbeat-ms 1000"
export OMP_NUM_THREADS=1
GZ=${GZ:-gradzip}
run() { name=$1; shift; $GZ chaos run $COMMON "$@" --train-args "--eval-batches 4" --out $OUT/$name; }
run hb1000-f1-kill-seed1 --faults-per-minute 1 --kinds kill --seed 1 --train-seed 1
run hb1000-f1-kill-seed3 --faults-per-minute 1 --kinds kill --seed 3 --train-seed 1
run hb1000-f1-kill-seed4 --faults-per-minute 1 --kinds kill --seed 4 --train-seed 1
run hb1000-f1-kill-seed2 --faults-per-minute 1 --kinds kill --seed 2 --train-seed 1
run hb1000-f4-kill --faults-per-minute 4 --kinds kill --seed 1 --train-seed 1
run hb1000-f0-s1 --faults-per-minute 0 --seed 1 --train-seed 1
$GZ chaos compare $OUT/hb1000-f0-s1 $OUT/hb1000-f1-kill-seed1 $OUT/hb1000-f1-kill-seed2 $OUT/hb1000-f1-kill-seed3 \
    $OUT/hb1000-f1-kill-seed4 $OUT/hb1000-f4-kill --out $FIG
