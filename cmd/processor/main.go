// Command processor consumes Kafka topics and applies every record to PostgreSQL exactly once,
// with a built-in handler chosen by HANDLER. It is configured by environment variables (see
// README.md) and exits 0 after a clean shutdown on SIGTERM, 2 on bad configuration.
//
//	processor [run]    consume and apply (default)
//	processor migrate  create or upgrade kafkapg's tables, then exit
package main

import (
	"os"

	"github.com/kafkapg/kafkapg/internal/service"
)

func main() {
	os.Exit(service.Main(os.Args[1:], os.Stderr))
}
