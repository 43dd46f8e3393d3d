# Source on the GPU machine (bash):  . llama-cuda/env.sh
# 1. unpacks llama-bench from llama-bench.xz beside this file (once; xz, else Python's lzma);
# 2. puts the CUDA 13 libraries of the pip nvidia-* wheels (torch's own: libcudart.so.13, libcublas.so.13,
#    libcublasLt.so.13) on LD_LIBRARY_PATH, and sets LLAMA_LIBS to that list and LLAMA_BENCH to the binary, for
#    python3 bench/llama_cpp_peer.py --gpu --llama-bench $LLAMA_BENCH --llama-env LD_LIBRARY_PATH=$LLAMA_LIBS ...
_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -x "$_here/llama-bench" ] && [ -f "$_here/llama-bench.xz" ]; then
    { xz -dc "$_here/llama-bench.xz" 2>/dev/null ||
      python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' \
          "$_here/llama-bench.xz"; } > "$_here/llama-bench.tmp" && chmod +x "$_here/llama-bench.tmp" &&
        mv "$_here/llama-bench.tmp" "$_here/llama-bench"
fi
export LLAMA_BENCH="$_here/llama-bench"
_nv=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null) ||
    _nv=$(python3 -c 'import site; print(site.getsitepackages()[0])')/nvidia
LLAMA_LIBS=$(find "$_nv" \( -name 'libcudart.so.13' -o -name 'libcublas.so.13' -o -name 'libcublasLt.so.13' \) \
    -printf '%h\n' | sort -u | paste -sd:)
[ -n "$LLAMA_LIBS" ] || echo "env.sh: no libcudart.so.13 / libcublas.so.13 under $_nv" >&2
export LLAMA_LIBS
export LD_LIBRARY_PATH="$LLAMA_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
unset _nv _here
