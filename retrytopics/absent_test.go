package retrytopics

import (
	"errors"
	"testing"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
)

// TestTopicAbsent: only "unknown topic" (or no metadata at all) means a topic does not exist;
// a transient or authorization error must not be reported as a missing topic, nor lead to
// creating one.
func TestTopicAbsent(t *testing.T) {
	for _, tt := range []struct {
		name    string
		d       kadm.TopicDetail
		ok      bool
		absent  bool
		wantErr error
	}{
		{"not in the metadata", kadm.TopicDetail{}, false, true, nil},
		{"unknown topic", kadm.TopicDetail{Topic: "t", Err: kerr.UnknownTopicOrPartition}, true, true, nil},
		{"exists", kadm.TopicDetail{Topic: "t"}, true, false, nil},
		{"leader election", kadm.TopicDetail{Topic: "t", Err: kerr.LeaderNotAvailable}, true, false, kerr.LeaderNotAvailable},
		{"not authorized", kadm.TopicDetail{Topic: "t", Err: kerr.TopicAuthorizationFailed}, true, false, kerr.TopicAuthorizationFailed},
	} {
		absent, err := topicAbsent(tt.d, tt.ok)
		if absent != tt.absent || !errors.Is(err, tt.wantErr) || (tt.wantErr == nil) != (err == nil) {
			t.Errorf("%s: topicAbsent = %v, %v; want %v, %v", tt.name, absent, err, tt.absent, tt.wantErr)
		}
	}
}
