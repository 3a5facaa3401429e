# Sourced by the GPU scripts: sets $card to the GPU's short name (h200, h100; gpu if the name
# has none), which names every result file: a run on an H100 is not the H200's.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'h[0-9]{3}' | tr 'H' 'h')
card="${card:-gpu}"
