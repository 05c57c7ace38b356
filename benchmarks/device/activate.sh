# Source this at the start of a device command, from the project root:
#   source .device/activate.sh && python3 -m benchmarks.run kernels
# Unpacks the bundle made by benchmarks/device/make-bundle.sh once per machine and puts it on the path.
if [ ! -d /tmp/gl-site/tilelang ]; then
  mkdir -p /tmp/gl-site && tar -xJf .device/site.tar.xz -C /tmp/gl-site || return 1
  z=$(ls /tmp/gl-site/z3/lib/libz3.so.* | head -1) && ln -sf "$(basename "$z")" /tmp/gl-site/z3/lib/libz3.so
fi
export PYTHONPATH=/tmp/gl-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export Z3_LIBRARY_PATH=/tmp/gl-site/z3/lib LD_LIBRARY_PATH=/tmp/gl-site/z3/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONUNBUFFERED=1
