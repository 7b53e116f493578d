#!/bin/sh
# repro-chaos, SparseLoCo: the same 4 replica groups on 2 emulated hosts at 100 Mbit/s as run.sh,
# with --sync ftsparseloco (its own codec: top-64 of each 64-element chunk, 2-bit values, error
# feedback with decay 0.95; H = 32 as DiLoCo's) instead of ftdiloco + top-k 1 %. Two fault-free
# baselines (training seeds 1 and 2), 1 fault a minute from fault seeds 1 and 3, 4 a minute. Needs root.
set -e
OUT=${OUT:-runs/repro-chaos}
FIG=${FIG:-docs/reproductions/repro-chaos/sparseloco}
COMMON="--groups 4 --hosts 2 --rate 100mbit --duration 180 --every 32 --recovery 5 --warm-spare 2
        --mode ftsparseloco --model bert-tiny --batch-size 8 --seq-len 64"
export OMP_NUM_THREADS=1
GZ=${GZ:-gradzip}
run() { name=$1; shift; $GZ chaos run $COMMON "$@" --train-args "--eval-batches 4" --out $OUT/$name; }
run sl-f0-s1 --faults-per-minute 0 --seed 1 --train-seed 1
run sl-f1-kill-seed1 --faults-per-minute 1 --kinds kill --seed 1 --train-seed 1
run sl-f4-kill --faults-per-minute 4 --kinds kill --seed 1 --train-seed 1
run sl-f1-kill-seed3 --faults-per-minute 1 --kinds kill --seed 3 --train-seed 1
run sl-f0-s2 --faults-per-minute 0 --seed 1 --train-seed 2
$GZ chaos compare $OUT/sl-f0-s1 $OUT/sl-f0-s2 $OUT/sl-f1-kill-seed1 $OUT/sl-f1-kill-seed3 $OUT/sl-f4-kill --out $FIG
