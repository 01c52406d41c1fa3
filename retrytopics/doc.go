// Package retrytopics names and describes the topics a record goes to when it cannot be applied:
// the dead-letter topic {topic}.{group}.dlq, and the headers that travel with a dead-lettered
// record so an operator can tell where it came from and why it failed.
//
// A dead-lettered record keeps the original key, value and headers; kafkapg appends headers whose
// names start with "kafkapg-" (see the Header* constants). Headers with that prefix already on the
// record (for example after a replay) are replaced, not duplicated.
//
// Tiered retry topics ({topic}.{group}.retry.{n}) are not implemented yet: with no retry tiers, a
// record whose local retries are exhausted goes straight to the dead-letter topic.
package retrytopics
