#!/usr/bin/env bash
# Single-node launcher: `empg train` on N processes under torchrun.
#
#   launchers/torchrun.sh CONFIG.yaml [a.b.c=value ...] [--resume]
#   NPROC_PER_NODE=4 launchers/torchrun.sh recipes/demo_cpu.yaml parallel.tensor_model_parallel_size=2
#
# Runs (from the repository root, where recipes' relative paths point; the package must be importable):
#   torchrun --standalone --nproc-per-node N -m megatron_empg.trainer.cli train CONFIG [overrides...] [--resume]
# (`-m megatron_empg.trainer.cli` is what the `empg` console script runs.)
#
# N: $NPROC_PER_NODE, else the number of GPUs nvidia-smi lists, else 2. Tensor x pipeline parallel
# sizes come from the config; the rest of the N processes are data parallel. Before anything starts,
# the resolved config is checked against N (N divisible by parallel.tensor_model_parallel_size x
# parallel.pipeline_model_parallel_size, each step's prompts split over the data-parallel replicas):
# exit code 2 with a message naming the field otherwise.
#
# Without GPUs (gloo), the vLLM engine cannot run inside a training rank of a world > 1, so unless the
# command line sets them this adds rollout.in_process=false (the engine core in its own process, on
# rank 0) and weight_sync.transport=shm_file (weights through /dev/shm files).
#
# SIGTERM or SIGUSR1 (Slurm's pre-emption warning) sent to this script reaches every rank as SIGUSR1:
# the ranks finish the current step, checkpoint together and exit 0 (torchrun itself then exits
# non-zero: it re-raises the signal); continue with --resume. torchrun kills ranks still saving after
# $TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default here 300). SIGINT (Ctrl-C) aborts.
#
# Restarts: a run that ends restartable (a hang the ranks' watchdog found, a rank or node lost, exit
# code 3, ranks killed by a signal this script did not send) is started again with --resume, up to
# supervisor.max_restarts times within supervisor.restart_window_s (megatron_empg/trainer/run/restarts.py
# decides; <logging.dir>/restarts.jsonl keeps each attempt and its cause). A clean end, a configuration
# error (exit 2), a crash or a signal to this script ends it. Beside each attempt, `restarts --watch`
# kills a rank stopped (SIGSTOP) after a peer ended, which no rank's watchdog is left to find.
# Environment: PYTHON (default python) and TORCHRUN (default torchrun), e.g. from .venv/bin.
set -euo pipefail

usage() {
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

[[ $# -ge 1 ]] || usage
case "$1" in -h | --help) usage ;; esac

config=$1
shift
overrides=()
resume=()
for arg in "$@"; do
    case "$arg" in
        --resume) resume=(--resume) ;;
        -*) echo "torchrun.sh: error: unknown option $arg (only --resume; overrides are a.b.c=value)" >&2; exit 2 ;;
        *) overrides+=("$arg") ;;
    esac
done

PYTHON=${PYTHON:-python}
TORCHRUN=${TORCHRUN:-torchrun}

gpus=0
if command -v nvidia-smi > /dev/null 2>&1; then
    gpus=$(nvidia-smi --list-gpus 2> /dev/null | grep -c '^GPU' || true)
fi
nproc=${NPROC_PER_NODE:-}
if [[ -z "$nproc" ]]; then
    nproc=$((gpus > 0 ? gpus : 2))
fi
if ! [[ "$nproc" =~ ^[1-9][0-9]*$ ]]; then
    echo "torchrun.sh: error: NPROC_PER_NODE must be a positive integer, got '$nproc'" >&2
    exit 2
fi

# The resolved config (file + overrides) against the world of $nproc processes (exit 2 if it does not
# fit); without GPUs, the CPU defaults are added where the command line does not set them.
check=(--prog torchrun.sh --world-size "$nproc" --checked-for "NPROC_PER_NODE=$nproc")
if ((gpus == 0)); then
    check+=(--cpu)
else
    check+=(--tasks-per-node "$nproc" --gpus-per-node "$gpus")
fi
resolved=$("$PYTHON" -m megatron_empg.trainer.bind.launch_check "${check[@]}" "$config" \
    ${overrides[@]+"${overrides[@]}"}) || exit $?
overrides=()
[[ -z "$resolved" ]] || mapfile -t overrides <<< "$resolved"

# torchrun sends a signal it handles to each rank's whole process group (the vLLM engine's processes
# included) and then waits this long for the ranks to exit (torch >= 2.8 reads both settings; older
# versions handle their defaults, without SIGUSR1, and wait 30 s).
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}
# torchrun runs as a job of its own (set -m: its own process group, SIGINT not ignored), so signals
# reach it only through the traps below: SIGTERM becomes SIGUSR1, which the trainer's ranks take as
# "checkpoint after this step and stop" and the processes they start ignore (so does SIGTERM).
set -m
restarts=("$PYTHON" -m megatron_empg.trainer.run.restarts "$config" ${overrides[@]+"${overrides[@]}"})
signalled=0
torchrun_pid=
trap 'signalled=1; [[ -z "$torchrun_pid" ]] || kill -USR1 "$torchrun_pid" 2> /dev/null || true' TERM USR1
trap 'signalled=1; [[ -z "$torchrun_pid" ]] || kill -INT "$torchrun_pid" 2> /dev/null || true' INT
attempt=0
while :; do
    "${restarts[@]}" --begin || exit $?
    started=$(date +%s.%N)
    "$TORCHRUN" --standalone --nproc-per-node "$nproc" -m megatron_empg.trainer.cli train "$config" \
        ${overrides[@]+"${overrides[@]}"} ${resume[@]+"${resume[@]}"} &
    torchrun_pid=$!
    # a rank stopped after its peers ended is watched by no watchdog: this kills it (restarts.py)
    "${restarts[@]}" --watch "$torchrun_pid" --started "$started" &
    watch_pid=$!
    while :; do
        status=0
        wait "$torchrun_pid" || status=$?
        kill -0 "$torchrun_pid" 2> /dev/null || break # else a trapped signal interrupted the wait
    done
    torchrun_pid=
    kill "$watch_pid" 2> /dev/null || true
    wait "$watch_pid" 2> /dev/null || true
    ((status != 0 || signalled)) || exit 0
    why=()
    ((signalled == 0)) || why=(--signalled)
    "${restarts[@]}" --attempt "$attempt" --started "$started" --status "$status" ${why[@]+"${why[@]}"} >&2 ||
        exit "$status"
    attempt=$((attempt + 1))
    resume=(--resume)
done
