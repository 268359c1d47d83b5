# azqemu: the two commands that matter are `make demo` and `make test` (see README.md).
# Both work on a fresh Debian 12 machine as root: they install what is missing (apt packages,
# the venv, the userfaultfd export library, the guest image), start virtlogd/libvirtd, and run.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
AZQ := $(VENV)/bin/azq
APT_PACKAGES := qemu-system-x86 qemu-utils libvirt-daemon-system libvirt-clients libvirt-dev \
	pkg-config debootstrap e2fsprogs busybox-static cpio kmod zstd xz-utils gcc make \
	python3-venv liblzo2-dev util-linux iproute2 procps tini prometheus
PLACEMENT_VENV := .placement-venv
PYTEST_ARGS ?=

.PHONY: all deps venv placement-venv lib image host test unit integration lint demo perf clean

all: venv lib

deps: .deps.stamp
.deps.stamp: Makefile
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing: $$missing"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
		case "$$missing" in *prometheus*) \
			/etc/init.d/prometheus status >/dev/null 2>&1 && /etc/init.d/prometheus stop || true;; \
		esac; \
	fi
	@touch $@

venv: $(VENV)/.stamp
$(VENV)/.stamp: pyproject.toml .deps.stamp
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

# OpenStack Placement for the integration tests (tests/support/services.py), in a venv of its
# own: its pins must not meet the project's.
placement-venv: $(PLACEMENT_VENV)/.stamp
$(PLACEMENT_VENV)/.stamp: .deps.stamp
	test -x $(PLACEMENT_VENV)/bin/python || $(PYTHON) -m venv $(PLACEMENT_VENV)
	$(PLACEMENT_VENV)/bin/pip install -q openstack-placement
	@touch $@

# The userfaultfd export library loaded into QEMU, and the page codec's C loops (optional:
# azqemu.memory falls back to numpy/Python without them, at about half the speed).
lib: qemu-patches/libazq_uffd.so azqemu/memory/_pagecodec.so azqemu/memory/_storeview.so azqemu/restore/_faultloop.so
qemu-patches/libazq_uffd.so: qemu-patches/azq_uffd.c .deps.stamp
	gcc -O2 -Wall -Wextra -fPIC -shared -pthread -o $@ $<
azqemu/memory/_pagecodec.so: azqemu/memory/_pagecodec.c azqemu/memory/_pagepatch.h .deps.stamp
	gcc -O2 -Wall -Wextra -fPIC -shared -o $@ $< -l:libzstd.so.1
# The native fault path: the store's C lookup and the fault thread (restore/native.py).
azqemu/memory/_storeview.so: azqemu/memory/_storeview.c azqemu/memory/_pagepatch.h .deps.stamp
	gcc -O2 -Wall -Wextra -fPIC -shared -pthread -o $@ $< -l:libzstd.so.1
azqemu/restore/_faultloop.so: azqemu/restore/_faultloop.c .deps.stamp
	gcc -O2 -Wall -Wextra -fPIC -shared -pthread -o $@ $<

image: venv
	$(AZQ) image build

host: image
	$(AZQ) host setup
	$(AZQ) doctor

unit: venv lib
	$(PY) -m pytest -q --durations=15 tests/unit $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check azqemu tests
	$(VENV)/bin/mypy azqemu

integration: host lib placement-venv
	$(PY) -m pytest -q --durations=15 tests/integration $(PYTEST_ARGS)

test: host lib lint placement-venv
	$(PY) -m pytest -q --durations=15 tests/unit tests/integration $(PYTEST_ARGS)

demo: host lib
	$(AZQ) demo

perf: host lib
	$(PY) -m pytest -s -q tests/perf $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(PLACEMENT_VENV) .deps.stamp qemu-patches/libazq_uffd.so azqemu/memory/_pagecodec.so \
		azqemu/memory/_storeview.so azqemu/restore/_faultloop.so
