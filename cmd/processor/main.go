// Command processor is the kafkapg service with the built-in handlers of examples/ledger: it
// consumes Kafka topics and applies every record to PostgreSQL exactly once. It is configured by
// environment variables (docs/configuration.md); see package service for its commands and exit
// statuses. Your own service is the same main with your handlers.
//
//	HANDLER=ledger           the demo's ledger of accounts and transfers
//	HANDLER=ledger-careless  the same ledger written carelessly (for the fault-injection suite)
//	HANDLER=ledger-careless-slow  ledger-careless behind a Prepare that waits 0-5 ms, as a
//	                         call to another system does (for CONCURRENCY above 1)
//	HANDLER=ledger-forward   stage 1 of a chain: the ledger, emitting a posting per event to
//	                         <topic>.postings through the outbox, deduplicated on event_id
//	HANDLER=ledger-post      stage 2: the postings, deduplicated on their message id
//	HANDLER=ledger-avro      the ledger of events in Avro, in the Schema Registry's wire format
//	                         (SCHEMA_REGISTRY_URL): decoded before the handler, an outage waits
package main

import (
	"time"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/processor/schemaregistry"
	"github.com/kafkapg/kafkapg/service"
)

func main() {
	service.Main(
		service.Handler{Name: "ledger", Handler: ledger.Handler{}, Setup: service.SetupSQL(ledger.Schema)},
		service.Handler{Name: "ledger-careless", Handler: ledger.Careless{}, Setup: service.SetupSQL(ledger.CarelessSchema)},
		service.Handler{Name: "ledger-careless-slow", Handler: ledger.NewPrepared(ledger.Careless{}, 5*time.Millisecond),
			Setup: service.SetupSQL(ledger.CarelessSchema + ledger.PreparedSchema)},
		service.Handler{Name: "ledger-forward", Handler: ledger.Forward{}, Setup: service.SetupSQL(ledger.Schema), IdempotencyKey: ledger.StageOneKey},
		service.Handler{Name: "ledger-post", Handler: ledger.Post{}, Setup: service.SetupSQL(ledger.ChainSchema), IdempotencyKey: ledger.StageTwoKey},
		service.Handler{Name: "ledger-avro", Handler: ledger.Handler{}, Setup: service.SetupSQL(ledger.Schema),
			Values: schemaregistry.AvroFormat[ledger.Event](ledger.EventAvroSchema)},
	)
}
