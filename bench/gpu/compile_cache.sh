# Sourced by the serve scripts once VLLM_CACHE_ROOT is set. vLLM keys its torch.compile cache
# ($VLLM_CACHE_ROOT/torch_compile_cache) by every config and code hash that shapes the
# compiled graphs, and documents copying it to another deployment to skip compilation: 40 s
# of a Qwen3-32B server's ~150 s start on an H100 (2026-12-07). A fresh device machine has
# none. compile_cache_keep sends the machine's cache back in $OUT/cache (gzip'd tar in parts
# of 15 MiB: the device returns files of at most 16 MiB) when it is at most
# COMPILE_CACHE_MAX_MB (default 30); copied into .stage/compile_cache here and carried, it
# is unpacked once per machine by compile_cache_restore. A stale entry is never used: a
# code or config change gives a new hash, and that server compiles as before.
cache_parcel=.stage/compile_cache

compile_cache_restore() {
  local parts=("$cache_parcel"/torch_compile_cache.tgz.part-*)
  [ -f "${parts[0]}" ] && [ ! -e "$VLLM_CACHE_ROOT/.restored" ] || return 0
  mkdir -p "$VLLM_CACHE_ROOT"
  if cat "${parts[@]}" | tar -C "$VLLM_CACHE_ROOT" -xzf -; then
    touch "$VLLM_CACHE_ROOT/.restored"
    echo "compile cache: restored $(du -sh "$VLLM_CACHE_ROOT/torch_compile_cache" | cut -f1)"
  else
    echo "compile cache: the carried parts did not unpack; compiling from scratch"
    rm -rf "$VLLM_CACHE_ROOT/torch_compile_cache"
  fi
}

compile_cache_keep() {
  # The limit is on the compressed size, which is what travels: a Qwen3-32B server's
  # cache was 62 MiB on disk on an H100 (2026-12-07), over the limit before compression.
  local dir="$VLLM_CACHE_ROOT/torch_compile_cache" max_mb="${COMPILE_CACHE_MAX_MB:-30}"
  local packed="/tmp/torch_compile_cache.tgz" mb
  [ -d "$dir" ] || return 0
  tar -C "$VLLM_CACHE_ROOT" -czf "$packed" torch_compile_cache || { rm -f "$packed"; return 0; }
  mb=$(( ($(stat -c %s "$packed") + 1048575) / 1048576 ))
  if [ "$mb" -gt "$max_mb" ]; then
    echo "compile cache: $(du -sm "$dir" | cut -f1) MiB, ${mb} MiB compressed, over ${max_mb} MiB: not sent back"
    rm -f "$packed"
    return 0
  fi
  rm -rf "$OUT/cache" && mkdir -p "$OUT/cache"  # a later script's cache holds the earlier's
  split -b 15m -d "$packed" "$OUT/cache/torch_compile_cache.tgz.part-"
  rm -f "$packed"
  echo "compile cache: ${mb} MiB compressed, sent back in $(ls "$OUT/cache" | wc -l) part(s) (\$OUT/cache)"
}
