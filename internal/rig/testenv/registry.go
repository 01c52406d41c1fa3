package testenv

import (
	"os"
	"testing"
)

// SchemaRegistry returns the URL of the real Schema Registry the tests run against (a
// Confluent-compatible API: Apicurio's, from scripts/schema-registry.sh), from
// TEST_SCHEMA_REGISTRY_URL. A test that needs it fails (it is not skipped) when that is unset:
// `make test` starts a registry and sets it. The registry is shared by the run's tests: each
// registers its schemas under subjects named after itself (Name).
func SchemaRegistry(t testing.TB) string {
	t.Helper()
	u := os.Getenv("TEST_SCHEMA_REGISTRY_URL")
	if u == "" {
		t.Fatal("TEST_SCHEMA_REGISTRY_URL is not set. Run `make test` (it starts a Schema Registry), or " +
			"scripts/schema-registry.sh with TEST_SCHEMA_REGISTRY_URL go test ...")
	}
	return u
}
