// Package doccheck has no code: its tests check the repository's Markdown (README.md, docs/,
// deploy/README.md), so that every relative link leads somewhere.
package doccheck
