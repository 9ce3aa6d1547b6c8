# Source this on the GPU machine, from the repo root: carried wheels into /tmp/site, libaio from
# carried Debian .debs (unpacked, not installed: the image has no libaio), and the variables that
# let DeepSpeed's JIT build of its async_io op find them.
#   source benchmarks/experiments/peer_env.sh     (needs .whl in the device tool's carry list, and .deb
#   wherever DeepSpeed offloads to NVMe)
_repo=$(pwd)
_aio_lib=""
if ls "$_repo"/.deb/*.deb >/dev/null 2>&1; then
    mkdir -p /tmp/libaio
    for deb in "$_repo"/.deb/*.deb; do dpkg -x "$deb" /tmp/libaio || return 1; done
    _aio_lib=$(dirname "$(find /tmp/libaio -name 'libaio.so*' | head -1)")
    # libaio-dev's libaio.so link may point at an absolute /lib path: link to the unpacked runtime.
    if [ ! -e "$_aio_lib/libaio.so" ]; then
        ln -sf "$(ls "$_aio_lib"/libaio.so.1* | head -1)" "$_aio_lib/libaio.so"
    fi
    export CPATH=/tmp/libaio/usr/include${CPATH:+:$CPATH}
    export LIBRARY_PATH=$_aio_lib${LIBRARY_PATH:+:$LIBRARY_PATH}
    export LD_LIBRARY_PATH=$_aio_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# The peers' wheels (deepspeed 0.19.8 built with DS_BUILD_OPS=0, and what it needs that the image lacks) sit in
# .whl/peers/, apart from .whl/*.whl, which every experiment installs: only the peers' runs take them.
if ls "$_repo"/.whl/peers/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.peers_installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site "$_repo"/.whl/peers/*.whl \
        && touch /tmp/site/.peers_installed || return 1
fi
export PYTHONPATH=/tmp/site:$_repo${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH  # the carried ninja, which torch's JIT build of DeepSpeed's ops calls by name
export TORCH_CUDA_ARCH_LIST=9.0 DS_BUILD_OPS=0 PYTHONUNBUFFERED=1
if [ -n "$_aio_lib" ]; then
    echo "setup_gpu_peer: wheels in /tmp/site, libaio in $_aio_lib ($(ls "$_aio_lib" | tr '\n' ' '))"
else
    echo "setup_gpu_peer: wheels in /tmp/site; no .deb/*.deb carried, so no libaio (DeepSpeed's NVMe offload needs it)"
fi
