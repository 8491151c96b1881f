# Sourced by the device entry points (device_run.sh, diag/run_*.sh, multigpu/run_multi.sh): the GPU machine has no
# registry, so the wheels come with the call (carry: .whl_upstream). .whl_upstream/site/ holds the pure-Python
# wheels the GPU image lacks (pydantic, pydantic-core, annotated-types, typing-inspection, hjson), needed by our
# engine and upstream alike; .whl_upstream/ itself holds upstream DeepSpeed's no-ops wheel
# (`python benchmarks/baselines/upstream.py prepare`).

# install_site_wheels REPO: our engine's missing dependencies into /tmp/site (fails the caller when missing).
install_site_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$1"/.whl_upstream/site/*.whl
}

# install_upstream_wheel REPO: upstream DeepSpeed 0.19.8 into /tmp/upstream_ds (a failure only warns: the
# upstream rows then fail on their own).
install_upstream_wheel() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/upstream_ds \
      "$1"/.whl_upstream/deepspeed-0.19.8-py3-none-any.whl || echo "upstream install FAILED (upstream rows will fail)"
}
