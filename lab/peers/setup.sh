#!/usr/bin/env bash
# Make one virtual environment per peer checkpoint engine, for `python -m lab ckpt-peers` (lab/peers/).
#
#   lab/peers/setup.sh                  # all peers
#   lab/peers/setup.sh dlrover          # only some: bytecheckpoint, dlrover, nvidia-resiliency-ext
#
# Each peer gets its own venv under $TIDAL_PEER_VENVS (default: <repo>/.peer-venvs, gitignored) with
# torch==2.13.0 (Tidal's pin; the CPU build on a machine with a local wheel), so that a peer's pins can
# never touch Tidal's environment. torch is held at 2.13.0 by a constraints file: a peer that pins another
# torch (ByteCheckpoint: torch<=2.5.0) is installed with --no-deps plus its other requirements as it
# declares them. The adapters import only torch, the peer, tidal.bench.ckpt_state and lab.peers
# (PYTHONPATH: src and the repository).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENVS=${TIDAL_PEER_VENVS:-$ROOT/.peer-venvs}
PY=${PYTHON:-python3.11}
ALL=(bytecheckpoint dlrover nvidia-resiliency-ext)
PEERS=("$@")
[ ${#PEERS[@]} -eq 0 ] && PEERS=("${ALL[@]}")

mkdir -p "$VENVS"
CONSTRAINTS="$VENVS/constraints.txt"
echo "torch==2.13.0" > "$CONSTRAINTS"

for peer in "${PEERS[@]}"; do
  venv="$VENVS/$peer"
  pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$CONSTRAINTS")
  echo "== $peer -> $venv"
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "${pip[@]}" "torch==2.13.0" numpy
  case "$peer" in
    bytecheckpoint)
      # 0.0.2 declares torch<=2.5.0; everything else it declares, as declared.
      "${pip[@]}" --no-deps "bytecheckpoint==0.0.2"
      "${pip[@]}" "mmh3>=4.1.0,<=4.2.0" "universal-pathlib>=0.2.2,<=1.0.0" "cachetools>=5.4.0,<=10.0.0" \
        "safetensors>=0.4.5,<=1.0.0" typing-extensions "grpcio==1.69.0" "protobuf==3.20.3"
      ;;
    dlrover)
      # The flash checkpoint imports grpc and tornado (declared only in its 'k8s' extra, with kubernetes).
      "${pip[@]}" "dlrover==0.6.1" grpcio tornado
      ;;
    nvidia-resiliency-ext)
      "${pip[@]}" "nvidia-resiliency-ext==0.4.1"
      ;;
    *)
      echo "unknown peer: $peer (known: ${ALL[*]})" >&2
      exit 2
      ;;
  esac
  "$venv/bin/python" -c "import torch; print('$peer: torch', torch.__version__)"
done
