#!/usr/bin/env bash
# Builds llama.cpp's llama-bench with its CUDA backend for the GPU machine (sm_90) on the dev machine, which has nvcc
# but no GPU and no cuBLAS: cuBLAS headers come from the nvidia-cublas wheel, the driver library is a stub that is
# only linked against. The result, llama-bench.xz (~22 MB), is carried to the GPU machine with env.sh beside it
# (README.md). About 75 minutes of 2 cores; run it in the background early in a session.
# These commands built the binary on 2026-12-02; as one script it has not been run end to end.
set -euo pipefail
out=$(cd "${1:-$(dirname "${BASH_SOURCE[0]}")}" && pwd)  # where llama-bench.xz goes (default: beside this script)
pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/llsrc      # llama_cpp_python-0.3.36.tar.gz
tar xzf /tmp/llsrc/llama_cpp_python-0.3.36.tar.gz -C /tmp/llsrc
cp -a /tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp /tmp/llama-cuda && rm -f /tmp/llama-cuda/.git  # a dangling gitdir file
pip download --no-deps nvidia-cublas==13.0.0.19 -d /tmp/cublas
mkdir -p /tmp/cublas/x && cd /tmp/cublas/x && unzip -q ../nvidia_cublas-13.0.0.19-py3-none-manylinux_2_27_x86_64.whl
# a stub libcuda.so.1 exporting every function of cuda.h, each returning CUDA_ERROR_NO_DEVICE (100)
mkdir -p /tmp/cudastub && cd /tmp/cudastub
echo '#include <cuda.h>' | gcc -E -I/usr/local/cuda/include - | grep -oE '\bcu[A-Z][A-Za-z0-9_]*\s*\(' | sed 's/\s*($//' | sort -u > syms.txt
sed 's/.*/int &(void) { return 100; }/' syms.txt > stub.c
gcc -shared -fPIC -O1 -o libcuda.so.1 -Wl,-soname,libcuda.so.1 stub.c && ln -sf libcuda.so.1 libcuda.so
cd /tmp/llama-cuda
CUBLAS=/tmp/cublas/x/nvidia/cu13
STUB=/tmp/cudastub
cmake -B build \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER=/usr/local/bin/nvcc -DCUDAToolkit_ROOT=/usr/local/cuda \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real \
  -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
  -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_COMMIT=0c1e57098 \
  -DCMAKE_SKIP_RPATH=ON \
  -DCMAKE_CUDA_FLAGS="-I$CUBLAS/include" -DCMAKE_CXX_FLAGS="-I$CUBLAS/include" \
  -DCUDA_cublas_LIBRARY=$CUBLAS/lib/libcublas.so.13 \
  -DCUDA_cublasLt_LIBRARY=$CUBLAS/lib/libcublasLt.so.13 \
  -DCUDA_cuda_driver_LIBRARY=$STUB/libcuda.so \
  -DOpenMP_gomp_LIBRARY=/usr/lib/gcc/x86_64-linux-gnu/12/libgomp.a \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$CUBLAS/lib -Wl,-rpath-link,$STUB"
nice -n 19 cmake --build build --target llama-bench -j2  # 144 CUDA files
strip -o "$out/llama-bench" build/bin/llama-bench && xz -9e -T2 -f "$out/llama-bench"

