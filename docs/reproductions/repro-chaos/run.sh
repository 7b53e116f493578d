#!/bin/sh
# repro-chaos: 4 ftdiloco replica groups (BERT-tiny, DiLoCo H = 32, topk 1 % + EF) on 2 emulated
# hosts at 100 Mbit/s, 180 s after the founding sync each; a killed group is replaced after 5 s by
# one of its two warm spares (--warm-spare 2). Needs root. Three fault-free baselines (training seeds 1, 2, 3:
# the seed spread of the loss) at the start, the middle and the end; 1 fault a minute from four
# fault seeds; 4 a minute, kills alone and mixed.
set -e
OUT=${OUT:-runs/repro-chaos}
FIG=${FIG:-docs/reproductions/repro-chaos}
COMMON="--groups 4 --hosts 2 --rate 100mbit --duration 180 --every 32 --recovery 5 --warm-spare 2
        --model bert-tiny --compressor topk:ratio=0.01,ef=true --batch-size 8 --seq-len 64"
export OMP_NUM_THREADS=1
GZ=${GZ:-gradzip}
run() { name=$1; shift; $GZ chaos run $COMMON "$@" --train-args "--eval-batches 4" --out $OUT/$name; }
run f0-s1 --faults-per-minute 0 --seed 1 --train-seed 1
run f1-kill-seed1 --faults-per-minute 1 --kinds kill --seed 1 --train-seed 1
run f1-kill-seed2 --faults-per-minute 1 --kinds kill --seed 2 --train-seed 1
run f4-kill --faults-per-minute 4 --kinds kill --seed 1 --train-seed 1
run f0-s2 --faults-per-minute 0 --seed 1 --train-seed 2
run f1-kill-seed3 --faults-per-minute 1 --kinds kill --seed 3 --train-seed 1
run f1-kill-seed4 --faults-per-minute 1 --kinds kill --seed 4 --train-seed 1
run f4-mixed --faults-per-minute 4 --kinds kill,stall,partition --seed 1 --train-seed 1
run f0-s3 --faults-per-minute 0 --seed 1 --train-seed 3
$GZ chaos compare $OUT/f0-s1 $OUT/f0-s2 $OUT/f0-s3 $OUT/f1-kill-seed1 $OUT/f1-kill-seed2 $OUT/f1-kill-seed3 \
    $OUT/f1-kill-seed4 $OUT/f4-kill $OUT/f4-mixed --out $FIG
