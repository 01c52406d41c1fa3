// Package retrytopics is the retry path: the topics a record goes to when it cannot be applied
// yet ({topic}.{group}.retry.{n}, one per tier) or ever ({topic}.{group}.dlq), the headers that
// travel with it, the due time of a retry, and the state of the path in Postgres (Store).
//
// A retry or dead-letter record keeps the original key, value and headers; kafkapg appends
// headers whose names start with "kafkapg-" (see the Header* constants). Headers with that prefix
// already on the record (from an earlier tier, or after a replay) are replaced, not duplicated.
//
// What it guarantees, given that callers run Store's methods in the transaction that moves the
// record off its partition: a record is in exactly one place at a time (its source partition, a
// tier, held behind its key, dead-lettered, applied); a duplicate copy of a retry record is
// recognised (its attempt does not match the retries table) and must be skipped; and a key whose
// record is in the path holds back the key's later records until the record is settled. What it
// does not: publishing is the outbox relay's (package sink), at least once; due times are wall
// clock times of the processor that recorded the failure.
package retrytopics
