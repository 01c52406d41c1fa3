package servicetest_test

import (
	"testing"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
)

// Each Service, its broker and its clients must be gone once its test has ended.
func TestMain(m *testing.M) { testenv.RunWithoutLeaks(m) }
