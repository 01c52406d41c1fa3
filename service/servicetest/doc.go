// Package servicetest runs a service of yours end to end in `go test`, as net/http/httptest runs
// an HTTP handler: your service.Handlers, configured by the environment variables of your
// Deployment and run as service.Main runs them (the same configuration, startup and consumer
// group), against a Kafka-protocol broker in the test process (franz-go's kfake) and a database
// of the test's own (processortest.DB: TEST_DATABASE_URL's server, or a throwaway one started
// from the PostgreSQL binaries). No Docker, nothing to run beforehand.
//
//	func TestOrders(t *testing.T) {
//		svc := servicetest.Start(t, servicetest.Options{
//			Env: map[string]string{
//				"KAFKA_TOPICS":         "orders",
//				"RETRY_LOCAL_ATTEMPTS": "1",
//			},
//			Topics: []string{"inventory.reserved"}, // where it emits
//		}, inventory)
//		svc.Produce("orders", "o-1", `{"order_id":"o-1","sku":"apple","qty":2}`)
//		svc.WaitQuery(8, `SELECT qty FROM stock WHERE sku = 'apple'`)
//		events := svc.WaitRecords("inventory.reserved", 1)
//		// ...
//	}
//
// A test produces records (Produce, ProduceRecords), waits for their effects in the database
// (WaitQuery, Eventually), for what the service published (WaitRecords: emitted events, retry
// and dead-letter copies) and for its dead letters (WaitDeadLetters); it acts as an operator
// does (ReplayDeadLetters, ReleaseKey, or any operator command with Command). Advance moves the
// retry path's clock: a record waiting in a retry tier for 30s or 5m is tried again at once,
// without the test waiting for it.
//
// A Service is one replica: a second one, on the same broker and database, in the same group, is
// started with the first's environment (Start(t, Options{Env: first.Env()}, ...)), and Stop
// stops one. The operator API and the console are served only if the environment asks for them.
// The service's log is kept, and printed when the test fails. Each Start takes about a second (the broker, a database, the group);
// tests that each Start their own may run in parallel.
package servicetest
