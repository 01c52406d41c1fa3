// Package doccheck has no code: its tests check the repository's Markdown (README.md, docs/,
// deploy/README.md), so that every relative link leads somewhere, every Go version they say a
// user needs is the one go.mod asks for, and docs/handlers.md's whole-file examples build.
package doccheck
