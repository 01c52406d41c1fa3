# kafkapg — run `make help` for the targets.
#
# Postgres: `make demo`, `make test` and `make bench` start a throwaway PostgreSQL cluster
# (scripts/with-postgres.sh) unless DATABASE_URL / TEST_DATABASE_URL is already set.
# Kafka: tests always run against an in-process kfake broker, and also against the real broker
# at KAFKA_BROKERS when that is set (`make kafka-start` starts one from Maven Central jars).

GO       ?= go
BIN      := bin
PKGS     := ./...
# -race needs cgo; the integration tests are long, so give them room.
TESTFLAGS ?= -race -count=1 -timeout 30m

.DEFAULT_GOAL := help

.PHONY: help
help: ## Show this help
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: build
build: ## Build bin/processor, bin/devbroker, bin/demo and bin/kafkapg (the dev loop)
	$(GO) build -o $(BIN)/ ./cmd/...

.PHONY: demo
demo: build ## Run the ledger demo: dev broker, throwaway Postgres, a Schema Registry when java can run one (the events in Avro), processor, report
	scripts/with-postgres.sh DATABASE_URL scripts/schema-registry.sh with-optional SCHEMA_REGISTRY_URL $(BIN)/demo

.PHONY: test
test: ## Unit and integration tests (real Postgres and Schema Registry; kfake, plus real Kafka if KAFKA_BROKERS is set)
	scripts/with-postgres.sh TEST_DATABASE_URL scripts/schema-registry.sh with TEST_SCHEMA_REGISTRY_URL $(GO) test $(TESTFLAGS) $(PKGS)

# PROTOCOL_CHECKS histories of about PROTOCOL_STEPS steps each (make test runs 10,000 of 100).
PROTOCOL_CHECKS ?= 300000
PROTOCOL_STEPS  ?= 300

.PHONY: protocol
protocol: ## The deduplication protocol's, the key ring's and the positions' property tests over far more histories (PROTOCOL_CHECKS: 300,000 of 300 steps, about 15 min)
	$(GO) test -count=1 -timeout 6h -run 'TestProtocol$$' ./internal/streams/ -rapid.checks=$(PROTOCOL_CHECKS) -rapid.steps=$(PROTOCOL_STEPS)
	$(GO) test -count=1 -timeout 6h -run 'TestRingProtocol$$' ./internal/keyring/ -rapid.checks=$(PROTOCOL_CHECKS)
	$(GO) test -count=1 -timeout 6h -run 'TestPositionsProtocol$$' ./internal/positions/ -rapid.checks=$(PROTOCOL_CHECKS) -rapid.steps=$(PROTOCOL_STEPS)

.PHONY: deploy-check
deploy-check: ## Validate deploy/: kustomize build, Kubernetes schemas, alert rules, dashboard PromQL
	cd deploy/validate && $(GO) test -count=1 ./...

.PHONY: chaos
chaos: build ## Fault-injection suite: kill, stop and cut processors, Postgres and the broker; check exactly-once
	$(GO) build -o $(BIN)/ ./internal/rig/chaos
	scripts/with-postgres.sh DATABASE_URL $(BIN)/chaos $(CHAOS_FLAGS)

# The topologies teams run (docs/testing.md): a three-broker Kafka cluster rolled and broken,
# Postgres failed over to a synchronous or an asynchronous standby or restored from a copy of its
# data directory, PgBouncer in transaction mode.
KAFKA_CLUSTER_DIR ?= /tmp/kafkapg-kafka-cluster

.PHONY: chaos-cluster
chaos-cluster: build ## make chaos against a three-broker Kafka cluster: broker kills, controlled shutdowns, freezes, a rolling restart
	$(GO) build -o $(BIN)/ ./internal/rig/chaos
	@if scripts/kafka.sh cluster status >/dev/null 2>&1; then \
		scripts/with-postgres.sh DATABASE_URL $(BIN)/chaos -kafka-cluster $(KAFKA_CLUSTER_DIR) $(CHAOS_FLAGS); \
	else \
		scripts/kafka.sh cluster start && \
		{ scripts/with-postgres.sh DATABASE_URL $(BIN)/chaos -kafka-cluster $(KAFKA_CLUSTER_DIR) $(CHAOS_FLAGS); rc=$$?; scripts/kafka.sh cluster stop; exit $$rc; }; \
	fi

.PHONY: chaos-failover-sync
chaos-failover-sync: build ## make chaos with Postgres failed over again and again to a synchronous standby
	$(GO) build -o $(BIN)/ ./internal/rig/chaos
	$(BIN)/chaos -postgres sync-standby $(CHAOS_FLAGS)

.PHONY: chaos-failover-async
chaos-failover-async: build ## make chaos with Postgres failed over to a lagging asynchronous standby (commits lost)
	$(GO) build -o $(BIN)/ ./internal/rig/chaos
	$(BIN)/chaos -postgres async-standby $(CHAOS_FLAGS)

.PHONY: chaos-restore
chaos-restore: build ## make chaos with Postgres restored from a copy of its data directory: commits lost, same identity
	$(GO) build -o $(BIN)/ ./internal/rig/chaos
	$(BIN)/chaos -postgres same-identity-restore $(CHAOS_FLAGS)

# RELEASE_BEFORE is the release that chaos-upgrade upgrades from and rolls back to (internal/schema's
# PreviousSchema names it); scripts/build-release.sh builds it from this clone's history.
RELEASE_BEFORE ?= f433fb8

.PHONY: chaos-upgrade
chaos-upgrade: build ## make chaos through a rolling upgrade from RELEASE_BEFORE (f433fb8), a rollback mid-rollout, forward again, finalize; Postgres failed over meanwhile
	scripts/build-release.sh $(RELEASE_BEFORE) $(BIN)/processor-$(RELEASE_BEFORE)
	$(GO) build -o $(BIN)/ ./internal/rig/chaos
	$(BIN)/chaos -upgrade-from $(BIN)/processor-$(RELEASE_BEFORE) -handler ledger-forward -postgres async-standby -duration 2m $(CHAOS_FLAGS)

.PHONY: chaos-registry
chaos-registry: build ## make chaos on Avro events in the Schema Registry's wire format: a real registry (started here), new schema versions during the run, the registry cut among the faults
	$(GO) build -o $(BIN)/ ./internal/rig/chaos
	scripts/with-postgres.sh DATABASE_URL scripts/schema-registry.sh with SCHEMA_REGISTRY_URL $(BIN)/chaos -schema-registry $(CHAOS_FLAGS)

.PHONY: chaos-pgbouncer
chaos-pgbouncer: build ## make chaos with the processors behind PgBouncer (Debian's) in transaction mode
	$(GO) build -o $(BIN)/ ./internal/rig/chaos
	scripts/with-postgres.sh DATABASE_URL $(BIN)/chaos -postgres pgbouncer $(CHAOS_FLAGS)

# BENCH picks the benchmarks (a regexp: `make bench BENCH='IdempotencyKeys|ChainDedupe'`). Each reads
# its sizes from the environment (BENCH_EVENTS, BENCH_ROUNDS, BENCH_BACKLOG_EVENTS,
# BENCH_BACKLOG_PARTITIONS, BENCH_BASELINE_BIN, BENCH_REPLAY_EVENTS, ...; see each benchmark's doc
# comment), which make passes on: `BENCH_BACKLOG_EVENTS=10000000 make bench BENCH=BacklogMemory`.
BENCH ?= .

.PHONY: bench
bench: ## End-to-end throughput and memory: kafkapg vs hand-written loops on the same data (durable Postgres); BENCH=<regexp> picks
	PG_FSYNC=on scripts/with-postgres.sh TEST_DATABASE_URL scripts/schema-registry.sh with TEST_SCHEMA_REGISTRY_URL $(GO) test -run '^$$' -bench '$(BENCH)' -benchtime 1x -count 1 -timeout 60m ./internal/rig/bench/

.PHONY: lint
lint: ## gofmt check, go.mod tidy check and go vet (staticcheck too if installed)
	$(GO) mod tidy -diff
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	cd deploy/validate && $(GO) mod tidy -diff && $(GO) vet ./...
	@if command -v staticcheck >/dev/null; then staticcheck $(PKGS); else echo "staticcheck not installed; skipped"; fi

.PHONY: fmt
fmt: ## Format the code
	gofmt -w $$(git ls-files '*.go')

.PHONY: kafka-start
kafka-start: ## Start a real single-node Apache Kafka (jars from Maven Central) on 127.0.0.1:9092
	scripts/kafka.sh start

.PHONY: kafka-stop
kafka-stop: ## Stop the Kafka broker started by kafka-start
	scripts/kafka.sh stop

.PHONY: clean
clean: ## Remove build output
	rm -rf $(BIN)
