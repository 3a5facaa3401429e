#!/usr/bin/env bash
# GPU machine, warm after parcels 1, 2 and the serve parcel (../shared/gpu/README.md). The KV
# cache each system's `vllm serve` gets at start-up, one short point each: stock, the plugin
# with its homes in the driver's host pages, and with them registered (cudaHostRegister).
#   bash bench/gpu/home_memory.sh MODEL REGIME      e.g. qwen3-32b 0.95
# Writes the three servers' logs and points, and $OUT/home_memory_<card>.json (bench.home_memory).
set -uo pipefail
source bench/gpu/card.sh
model="$1"; regime="$2"
point="tiny: poisson --rate 2 --seconds 5"
LABEL=stock bash bench/gpu/no_harm.sh stock "$model" "$regime" "$point" || exit 1
LABEL=plugin_driver PLUGIN_CONFIG='{"host_memory": "driver"}' \
  bash bench/gpu/no_harm.sh plugin "$model" "$regime" "$point" || exit 1
LABEL=plugin_register PLUGIN_CONFIG='{"host_memory": "register"}' \
  bash bench/gpu/no_harm.sh plugin "$model" "$regime" "$point" || exit 1
python3 -m bench.home_memory stock="$OUT/stock_server.log" \
  plugin_driver="$OUT/plugin_driver_server.log" plugin_register="$OUT/plugin_register_server.log" \
  --out "$OUT/home_memory_${card}.json"
