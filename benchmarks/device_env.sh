# Sourced by benchmarks/accelerator_device.sh and gpu_session.sh on a machine without network:
# installs the kit of benchmarks/device_kit.sh (.whl/*.whl) into /tmp/site, ahead of the image's
# packages on PYTHONPATH, with the repository, and keeps XLA's per-op info lines out of the logs.
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
  .whl/*.whl 2>&1 | grep -v -i 'warning' | tail -5
export PYTHONPATH=/tmp/site:$PWD
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}
